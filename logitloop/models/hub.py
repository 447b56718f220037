"""Models by their Hugging Face Hub name: `load_pretrained("org/name")`.

`model_folder(name, revision=, token=, cache_dir=)` turns what a user names a model by into
the local folder the loader reads: an existing folder as it is, anything else as a Hub repo
id, resolved with `huggingface_hub` into the shared Hugging Face cache
(`models--org--name/snapshots/<commit>/`, under `cache_dir`, else `HF_HUB_CACHE` or
`HF_HOME`/hub), downloading what is missing with the hub's own progress bar. Every place that
takes a model by name calls it: `load_pretrained`, the command line's `--model` and
`--draft-model`, the lm-eval backend's `pretrained=`, Ray jobs.

Only the files the loader reads are fetched (`METADATA_FILES`, then the safetensors weights:
`model.safetensors`, or the index and the shards it names); never `*.bin`, `*.pth`, `*.gguf`
or code. Before the weights are fetched the repo is checked: it has a `config.json` and
safetensors weights, and its config asks for no remote code (logitloop runs the
architectures it implements, and no code from a repo).

Offline (`HF_HUB_OFFLINE=1`), or when the Hub cannot be reached, a model in the cache loads
without any request; one that is not fails with a message naming the model, the revision,
the cache folder searched and how to download it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from logitloop.models.json_file import read_json

# What the loader reads besides the weights: the config and generation defaults, the
# tokenizer, the chat template (`logitloop.conversation`) and the weights' index.
METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
    "model.safetensors.index.json",
)
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Weights in formats logitloop does not read (pickles can run code): named when a repo has
# only these.
_OTHER_WEIGHTS = (".bin", ".pth", ".pt", ".ckpt", ".gguf", ".h5", ".msgpack")


def model_folder(
    name: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """The local folder of the model `name`: a folder, or a Hub repo id ("org/name").

    Args:
      name: an existing folder, or a Hugging Face Hub repo id.
      revision: the repo's branch, tag or commit hash (default "main"); only with a repo id.
      token: a Hub access token for a gated or private repo; None: the saved one (`hf auth
        login`) or `HF_TOKEN`; False: none.
      cache_dir: the Hugging Face cache folder; None: `HF_HUB_CACHE` (default
        `~/.cache/huggingface/hub`, or `$HF_HOME/hub`).

    Raises:
      FileNotFoundError: `name` is neither a folder nor a repo id; no such repo (or it is
        private and no token gives access) or revision; offline and not in the cache.
      PermissionError: the repo is gated and the token (or its absence) gives no access.
      ValueError: the repo has no config.json or no safetensors weights, or its config asks
        for remote code.
    """
    return _folder(_Snapshot, name, revision, token, cache_dir)


def adapter_folder(
    name: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """The local folder of the PEFT adapter `name`, as `model_folder` finds a model's: a
    folder, or a Hub repo id whose `adapter_config.json` and `adapter_model.safetensors`
    are fetched into the Hugging Face cache (nothing else; `ll.load_adapter` reads them as
    data). Raises as `model_folder` does."""
    return _folder(_AdapterSnapshot, name, revision, token, cache_dir)


def _folder(snapshot: type, name, revision, token, cache_dir) -> Path:
    what = snapshot.folder
    folder = Path(name).expanduser()
    if folder.is_dir():
        if revision is not None:
            raise ValueError(
                f"revision={revision!r} applies to a Hugging Face Hub repo id; {str(name)!r} "
                "is a local folder"
            )
        return folder
    if folder.exists():
        raise FileNotFoundError(f"{what} not found: {name} is a file, not a folder")
    repo = str(name)
    if isinstance(name, os.PathLike) or not _is_repo_id(repo):
        raise FileNotFoundError(
            f"{what} not found: {name} (nor is it a Hugging Face Hub repo id, "
            "'org/name': letters, digits, '-', '_' and '.')"
        )
    return snapshot(repo, revision, token, cache_dir).resolve()


def _is_repo_id(text: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


class _Snapshot:
    """One repo at one revision in the cache: found, checked and completed. A model's:
    `metadata` (its config `config` among them), then its weights."""

    kind, folder = "model", "checkpoint folder"
    metadata, config = METADATA_FILES, "config.json"

    def __init__(self, repo: str, revision: str | None, token, cache_dir):
        from huggingface_hub import constants

        self.repo, self.token = repo, token
        self.revision = revision or constants.DEFAULT_REVISION
        self.cache_dir = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE)
        self.where = f"{self.kind} {repo!r} (revision {self.revision!r})"

    def resolve(self) -> Path:
        from huggingface_hub import constants
        from huggingface_hub.errors import OfflineModeIsEnabled

        if constants.is_offline_mode():
            return self._cached("HF_HUB_OFFLINE is set")
        import httpx2

        try:
            info = self._api_call(self._model_info)
        except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled) as e:
            return self._cached(f"the Hub could not be reached ({type(e).__name__}: {e})")
        self._check_files({s.rfilename for s in info.siblings or ()})
        folder = self._download(self.metadata, self.revision)
        self._check_config(folder)
        # The weights at the commit the metadata came from, so that both are of one commit.
        self._download(self._weight_files(folder), folder.name)
        return folder

    # ------------------------------------------------------------------ online

    def _model_info(self):
        from huggingface_hub import HfApi

        return HfApi(token=self.token).model_info(self.repo, revision=self.revision)

    def _download(self, patterns, revision: str) -> Path:
        from huggingface_hub import snapshot_download

        return Path(
            self._api_call(
                lambda: snapshot_download(
                    self.repo,
                    revision=revision,
                    token=self.token,
                    cache_dir=self.cache_dir,
                    allow_patterns=list(patterns),
                )
            )
        )

    def _api_call(self, call):
        """`call()`, the Hub's answers that mean bad input as our errors."""
        from huggingface_hub.errors import (
            GatedRepoError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        try:
            return call()
        except GatedRepoError:
            raise PermissionError(
                f"{self.where}: the repo is gated, and {self._access()} it cannot be read: "
                "accept its terms on its Hub page, then log in (`hf auth login`), set "
                "HF_TOKEN or pass token="
            ) from None
        except RepositoryNotFoundError:
            raise FileNotFoundError(
                f"{self.where} is not a local folder, and the Hugging Face Hub has no such "
                f"repo (or it is private, and {self._access()} it cannot be read: log in with "
                "`hf auth login`, set HF_TOKEN or pass token=)"
            ) from None
        except RevisionNotFoundError:
            raise FileNotFoundError(
                f"{self.where}: the repo has no revision {self.revision!r} (a branch, tag or "
                "commit hash)"
            ) from None

    def _access(self) -> str:
        if isinstance(self.token, str):
            return "with the token given"
        from huggingface_hub import get_token

        if self.token is False or get_token() is None:
            return "without a token"
        return "with the saved token"

    # ------------------------------------------------------------------ offline

    def _cached(self, why: str) -> Path:
        """The snapshot already in the cache, checked as a download is; no request."""
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

        try:
            folder = Path(
                snapshot_download(
                    self.repo,
                    revision=self.revision,
                    cache_dir=self.cache_dir,
                    allow_patterns=list(self.metadata),
                    local_files_only=True,
                )
            )
        except IncompleteSnapshotError:  # some of the files the loader reads are missing
            raise FileNotFoundError(self._not_cached(why, "some of its files")) from None
        except LocalEntryNotFoundError:
            raise FileNotFoundError(self._not_cached(why)) from None
        present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        if self.config not in present:
            raise FileNotFoundError(self._not_cached(why, f"its {self.config}"))
        self._check_config(folder)
        missing = [f for f in self._weight_files(folder) if f not in present]
        if missing:
            raise FileNotFoundError(self._not_cached(why, f"its weights ({', '.join(missing)})"))
        return folder

    def _not_cached(self, why: str, what: str = "it") -> str:
        at = "" if self.revision == "main" else f" --revision {self.revision}"
        return (
            f"{self.where} is not a local folder, and the Hugging Face cache {self.cache_dir} "
            f"lacks {what}; {why}. Download it once with the network (without "
            f"HF_HUB_OFFLINE), e.g. `hf download {self.repo}{at}`"
        )

    # ------------------------------------------------------------------ checks

    def _check_files(self, names: set[str]) -> None:
        """The repo's files hold a config and safetensors weights."""
        if "config.json" not in names:
            raise ValueError(f"{self.where}: the repo has no config.json")
        if SINGLE_WEIGHTS in names or WEIGHTS_INDEX in names:
            return
        others = sorted(n for n in names if n.endswith(_OTHER_WEIGHTS))
        found = f"only {', '.join(others)}" if others else "no weights"
        raise ValueError(
            f"{self.where}: the repo has no safetensors weights ({SINGLE_WEIGHTS} or "
            f"{WEIGHTS_INDEX}), {found}; logitloop reads safetensors only (pickled weights "
            "can run code)"
        )

    def _check_config(self, folder: Path) -> None:
        config = _json_object(folder / "config.json")
        asks = [key for key in ("auto_map", "trust_remote_code") if config.get(key)]
        if asks:
            raise ValueError(
                f"{self.where}: its config.json asks for remote code ({', '.join(asks)}); "
                "logitloop runs no code from a repo: it loads the architectures it implements "
                "(logitloop.models.registry)"
            )

    def _weight_files(self, folder: Path) -> list[str]:
        index = folder / WEIGHTS_INDEX
        if not index.is_file():
            return [SINGLE_WEIGHTS]
        weight_map = _json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: missing 'weight_map'")
        names = sorted({str(v) for v in weight_map.values()})
        bad = [n for n in names if not n.endswith(".safetensors") or n.startswith(("/", ".."))]
        if bad:
            raise ValueError(f"{index}: names {bad[0]!r}, not a safetensors file of the repo")
        return names


class _AdapterSnapshot(_Snapshot):
    """A PEFT adapter's repo: its `adapter_config.json` and `adapter_model.safetensors`."""

    kind, folder = "adapter", "adapter folder"
    metadata, config = ("adapter_config.json",), "adapter_config.json"
    weights = "adapter_model.safetensors"

    def _check_files(self, names: set[str]) -> None:
        if self.config not in names:
            raise ValueError(f"{self.where}: the repo has no {self.config} (not a PEFT adapter)")
        if self.weights not in names:
            others = sorted(n for n in names if n.endswith(_OTHER_WEIGHTS))
            found = f"only {', '.join(others)}" if others else "no weights"
            raise ValueError(
                f"{self.where}: the repo has no {self.weights}, {found}; logitloop reads "
                "safetensors only (pickled weights can run code)"
            )

    def _check_config(self, folder: Path) -> None:
        """Read as data by `ll.load_adapter`, which checks its fields."""

    def _weight_files(self, folder: Path) -> list[str]:
        return [self.weights]


def _json_object(path: Path) -> dict[str, Any]:
    return read_json(path)
