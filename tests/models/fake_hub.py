"""A small Hugging Face Hub on 127.0.0.1 for the tests: `huggingface_hub` pointed at it (its
`ENDPOINT`, or `HF_ENDPOINT` for a subprocess) downloads into a real cache, laid out by
`huggingface_hub` itself.

It answers what `snapshot_download` and `model_info` ask, as the Hub answers them:
`GET /api/models/{repo}/revision/{rev}` (the commit and the file list),
`GET /api/models/{repo}/tree/{commit}` (the files with sizes and ids), and `HEAD`/`GET
/{repo}/resolve/{rev}/{file}` (the file, with the `X-Repo-Commit` and `ETag` headers). A
missing repo is the Hub's 401 `RepoNotFound`, a missing revision 404 `RevisionNotFound`, a
gated repo without the right token 401 `GatedRepo`. Every request is counted (`requests`).
The server listens on the loopback interface only, in a daemon thread, and stops when the
`with` block ends or after `lifetime_s` at the latest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from logitloop.models.loading import SHIPPED_MODEL_DIR


class FakeHub:
    def __init__(self, lifetime_s: float = 120.0):
        self.repos: dict[str, dict] = {}  # repo -> {"refs", "commits", "token"}
        self.requests: list[tuple[str, str]] = []
        self.lifetime_s = lifetime_s

    # ------------------------------------------------------------------ content

    def add_commit(self, repo: str, files: dict[str, bytes], *, branch: str = "main") -> str:
        """A commit of `files` on `branch` of `repo`; returns its hash."""
        entry = self.repos.setdefault(repo, {"refs": {}, "commits": {}, "token": None})
        digest = hashlib.sha1(repr(sorted(files.items())).encode() + repo.encode())
        commit = digest.hexdigest()
        entry["commits"][commit] = dict(files)
        entry["refs"][branch] = commit
        return commit

    def add_folder(self, repo: str, folder: Path, *, skip=(), **kw) -> str:
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        return self.add_commit(repo, {k: v for k, v in files.items() if k not in skip}, **kw)

    def gate(self, repo: str, token: str) -> None:
        """Only `token` may read `repo`."""
        self.repos[repo]["token"] = token

    # ------------------------------------------------------------------ the server

    def __enter__(self) -> FakeHub:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self.timer = threading.Timer(self.lifetime_s, self.server.shutdown)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def answer(self, method: str, path: str, auth: str | None):
        """(status, headers, body) for one request."""
        self.requests.append((method, path))
        parts = [unquote(p) for p in urlsplit(path).path.strip("/").split("/")]
        api = parts[:2] == ["api", "models"]
        if api:
            parts = parts[2:]
        repo, parts = _split_repo(parts, self.repos)
        if repo is None:
            return _error(401, "RepoNotFound", "Repository not found")
        entry = self.repos[repo]
        if entry["token"] is not None and auth != f"Bearer {entry['token']}":
            return _error(401, "GatedRepo", "Access to this model is restricted")
        if len(parts) < 2 or parts[0] not in ("revision", "tree", "resolve"):
            return _error(404, None, "Not found")
        kind, rev, rest = parts[0], parts[1], "/".join(parts[2:])
        commit = entry["refs"].get(rev, rev if rev in entry["commits"] else None)
        if commit is None:
            return _error(404, "RevisionNotFound", "Invalid rev id")
        files = entry["commits"][commit]
        if api and kind == "revision":
            siblings = [{"rfilename": name} for name in sorted(files)]
            body = {"id": repo, "modelId": repo, "sha": commit, "siblings": siblings}
            return _json(body)
        if api and kind == "tree":
            tree = [
                {"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for n, b in sorted(files.items())
            ]
            return _json(tree)
        if not api and kind == "resolve":
            if rest not in files:
                return _error(404, "EntryNotFound", "Entry not found")
            body = files[rest]
            etag = hashlib.sha1(body).hexdigest()
            headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"'}
            return 200, headers, body
        return _error(404, None, "Not found")


def _split_repo(parts: list[str], repos) -> tuple[str | None, list[str]]:
    for n in (2, 1):
        name = "/".join(parts[:n])
        if name in repos:
            return name, parts[n:]
    return None, parts


def _json(value) -> tuple[int, dict, bytes]:
    return 200, {"Content-Type": "application/json"}, json.dumps(value).encode()


def _error(status: int, code: str | None, message: str) -> tuple[int, dict, bytes]:
    headers = {"X-Error-Message": message}
    if code is not None:
        headers["X-Error-Code"] = code
    return status, headers, json.dumps({"error": message}).encode()


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        timeout = 30  # a stalled client never holds a thread for long

        def _reply(self, send_body: bool) -> None:
            status, headers, body = hub.answer(
                self.command, self.path, self.headers.get("Authorization")
            )
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def do_GET(self):
            self._reply(True)

        def do_HEAD(self):
            self._reply(False)

        def log_message(self, *args):
            pass

    return Handler


TINY = "org/tiny"  # the shipped model's folder, on the fake Hub


@contextlib.contextmanager
def serving(monkeypatch, tmp_path):
    """The fake Hub serving the shipped model as `TINY` (main), `huggingface_hub` pointed at
    it as `HF_ENDPOINT` would, online, with an empty cache (`HF_HUB_CACHE`, also
    `hub.cache`) and no token (none saved, no `HF_TOKEN`). A test module's `hub` fixture."""
    from huggingface_hub import constants

    with FakeHub() as fake:
        fake.tiny = fake.add_folder(TINY, SHIPPED_MODEL_DIR)
        fake.cache = tmp_path / "hf-cache"
        url_template = fake.url + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "ENDPOINT", fake.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url_template)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(fake.cache))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        yield fake


def offline(monkeypatch) -> None:
    """`HF_HUB_OFFLINE=1`, as `huggingface_hub` reads it."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
