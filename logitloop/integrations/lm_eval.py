"""An lm-evaluation-harness backend: `lm_eval --model logitloop` on a logitloop model.

    import logitloop, lm_eval
    lm_eval.simple_evaluate(model="logitloop", model_args="pretrained=PATH,dtype=float32",
                            tasks=["hellaswag"])

or from the command line, `logitloop eval --model logitloop --model_args ... --tasks ...`
(lm-eval's own CLI never imports outside code, so `logitloop eval` registers the backend
and then hands its arguments to that CLI, `logitloop.cli.run_eval`).

A thin adapter over the public API (docs/evaluation.md):

- `loglikelihood`: lm-eval's `TemplateLM` splits each (context, continuation) pair into
  tokens exactly as its `hf` backend does (trailing whitespace of the context moves to the
  continuation; an empty context becomes BOS, else EOS), with the checkpoint's
  `transformers` tokenizer, so both backends score the same ids; `ll.score` scores them
  (`raw_logprob_sum`, `is_greedy`), all of a call's requests at once, so the choices of
  one context share its prompt pass (`ll.score`'s shared prompts). A pair longer than
  `max_length + 1` tokens keeps its last `max_length + 1`, as `hf` cuts it (the context
  loses its first tokens; one warning says how many requests were cut); only a
  continuation of more than `max_length` tokens alone is refused.
- `loglikelihood_rolling`: lm-eval's rolling windows (`get_rolling_token_windows` with
  `context_len=1`, `make_disjoint_window`), as `hf` cuts them, scored like the above and
  summed per document: one float each.
- `generate_until`: `ll.generate_many` with the request's `until` (plus the EOS string, as
  `hf` adds it) as stop strings, `max_gen_toks` and the sampling keys of `gen_kwargs`; the
  continuation's ids decoded without special tokens and cut at the earliest stop string.

Constructing the backend turns on JAX's persistent compilation cache
(`ll.enable_compile_cache()`: `~/.cache/logitloop/jax`, or `LOGITLOOP_COMPILE_CACHE`), so a
second evaluation in a new process loads the programs the first compiled;
`compile_cache=false` (or `LOGITLOOP_COMPILE_CACHE=off`) keeps it off, `compile_cache=DIR`
uses that folder. (Importing the module sets nothing.)

`deterministic=True` (the default) runs the model with its reductions in a fixed order
(`logitloop.models.fixed_order`), so every per-sample log-likelihood and generated string
is bit for bit the same at any `batch_size`; it costs some speed (docs/numerics.md).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

import logitloop as ll

# gen_kwargs keys that map onto `SamplingParams.create` (lm-eval's names are hf's)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty")
DEFAULT_MAX_GEN_TOKS = 256  # hf's
AUTO_BATCH_SIZE = 32  # rows per call for batch_size=auto (results do not depend on it)


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"model_args {name}={value!r}: expected true or false")


def _parse_batch_size(value: Any, max_batch_size: Any) -> int:
    """An int >= 1, or `auto` / `auto:N` (lm-eval's spellings): `max_batch_size` rows, or
    AUTO_BATCH_SIZE. Scores do not depend on the batch size, so `auto` only sets speed."""
    text = str(value).strip().lower()
    if text.startswith("auto"):
        return int(max_batch_size) if max_batch_size else AUTO_BATCH_SIZE
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"model_args batch_size={value!r}: expected an integer >= 1 or 'auto'")
    return size


def _compile_cache(value: Any):
    """`compile_cache=true|false|DIR`: the `CompileCache` in use, or None (off)."""
    text = str(value).strip()
    if text.lower() in ("true", "1", "yes", "false", "0", "no"):
        if not _parse_bool("compile_cache", value):
            return None
        return ll.enable_compile_cache()
    if not text:
        raise ValueError("model_args compile_cache='': expected true, false or a folder")
    return ll.enable_compile_cache(text)


def _parse_mesh(value: Any):
    """`mesh=DxM`: a `jax.make_mesh((D, M), ("data", "model"))` over the first D*M devices."""
    if value is None or value == "":
        return None
    import jax

    if isinstance(value, jax.sharding.Mesh):
        return value
    match = re.fullmatch(r"\s*(\d+)\s*[x*]\s*(\d+)\s*", str(value))
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise ValueError(
            f"model_args mesh={value!r}: expected DATAxMODEL, e.g. mesh=2x1 "
            "(rows split 2 ways, weights whole)"
        )
    shape = (int(match[1]), int(match[2]))
    if shape[0] * shape[1] > jax.device_count():
        raise ValueError(
            f"model_args mesh={value!r} needs {shape[0] * shape[1]} devices; "
            f"there are {jax.device_count()}"
        )
    return jax.make_mesh(shape, ("data", "model"))


@register_model("logitloop")
class LogitloopLM(TemplateLM):
    """lm-eval's `LM` over a logitloop model (module docstring).

    model_args: `pretrained` (a Hugging Face Hub repo id, "org/name", found in the Hugging
    Face cache or downloaded into it, or a checkpoint folder; none: the shipped model; or a
    loaded logitloop model through `simple_evaluate(model=LogitloopLM(pretrained=model))`),
    `revision` (the repo's branch, tag or commit hash; default main), `dtype` (float32,
    bfloat16, float16; default the checkpoint's), `max_length` (tokens; default the
    model's context), `batch_size` (rows per call, or `auto`),
    `deterministic` (true, false or model-parallel; default true), `mesh` (DATAxMODEL),
    `prefix_cache` (default true: the choices of one context share its prompt pass, and
    generated rows the pages of a common prompt prefix), `add_bos_token`, `max_gen_toks` (as
    `hf`'s), `compile_cache` (default true: JAX's persistent compilation cache in the
    default folder, module docstring; false: off; or a folder), `adapter` (a PEFT LoRA
    adapter folder: every request runs under it, as `hf`'s `peft=`; docs/lora.md). Any
    other key is an error.
    """

    def __init__(
        self,
        pretrained: Any = None,
        revision: str | None = None,
        dtype: str | None = None,
        max_length: int | str | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | str | None = None,
        deterministic: bool | str = True,
        mesh: Any = None,
        prefix_cache: bool | str = True,
        add_bos_token: bool | str | None = None,
        max_gen_toks: int | str = DEFAULT_MAX_GEN_TOKS,
        compile_cache: bool | str = True,
        adapter: str | None = None,
        device: str | None = None,  # lm-eval passes its --device; JAX places arrays itself
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ValueError(
                f"model_args: unknown key(s) {', '.join(sorted(unknown))} for --model "
                "logitloop; known: pretrained, revision, dtype, max_length, batch_size, "
                "deterministic, mesh, prefix_cache, add_bos_token, max_gen_toks, "
                "compile_cache, adapter"
            )
        # Before the model loads, so that loading's programs are kept too.
        self.compile_cache = _compile_cache(compile_cache)
        if isinstance(pretrained, (str, type(None))) or hasattr(pretrained, "__fspath__"):
            try:
                self.model = ll.load_pretrained(
                    pretrained or None, revision=revision or None, dtype=dtype
                )
            except (OSError, ValueError) as e:
                raise ValueError(f"model_args pretrained={pretrained!r} does not load: {e}") from e
        else:
            if dtype is not None or revision:
                raise ValueError(
                    "model_args dtype and revision apply to a checkpoint name or path, not a "
                    "loaded model"
                )
            self.model = pretrained
        folder = getattr(self.model, "checkpoint_dir", None)
        if folder is None:
            raise ValueError(
                "model_args pretrained: the model has no checkpoint folder to read its "
                "tokenizer from (load it with ll.load_pretrained)"
            )
        import transformers

        # The checkpoint's `transformers` tokenizer, as the hf backend loads it, so that
        # both backends split and decode the same way.
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        self._tokenizer_name = str(folder)
        model_max = int(self.model.config.max_position_embeddings)
        self._max_length = model_max if max_length in (None, "") else int(max_length)
        if not 1 <= self._max_length <= model_max:
            raise ValueError(
                f"model_args max_length={max_length!r}: must be in [1, {model_max}], the "
                "model's context"
            )
        self._batch_size = _parse_batch_size(batch_size, max_batch_size)
        if isinstance(deterministic, str) and deterministic.strip().lower() == "model-parallel":
            self.deterministic: bool | str = "model-parallel"
        else:
            self.deterministic = _parse_bool("deterministic", deterministic)
        self.mesh = _parse_mesh(mesh)
        self.prefix_cache = _parse_bool("prefix_cache", prefix_cache)
        self.add_bos_token = (
            None if add_bos_token is None else _parse_bool("add_bos_token", add_bos_token)
        )
        self._max_gen_toks = int(max_gen_toks)
        if self._max_gen_toks < 1:
            raise ValueError(f"model_args max_gen_toks={max_gen_toks!r}: must be >= 1")
        # Every request's LoRA adapter: `ll.score`'s and `generate_many`'s keywords.
        self.adapter = {}
        if adapter not in (None, ""):
            from logitloop.jobs import JobError, load_adapters

            try:
                table = load_adapters(self.model, {"adapter": str(adapter)})
            except JobError as e:
                raise ValueError(f"model_args adapter={adapter!r}: {e}") from None
            self.adapter = {"adapters": table, "adapter": "adapter"}

    # ------------------------------------------------------------------ what lm-eval reads

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # The empty context's stand-in, as hf's: BOS, else EOS.
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return self._tokenizer_name.replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        # hf's rule: a string that already starts with the BOS text gets no second BOS.
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(
            string, self.tokenizer.decode(self.prefix_token_id)
        ):
            special["add_special_tokens"] = False
        return list(self.tokenizer.encode(string, **special))

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The tokenizer's chat rendering (lm-eval's `--apply_chat_template`), as `hf`'s:
        a template that refuses a system message gets the history without it."""
        import jinja2

        def render(history):
            return self.tokenizer.apply_chat_template(
                history,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
            )

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            return render([m for m in chat_history if m["role"] != "system"])

    # ------------------------------------------------------------------ scoring

    def _progress(self, total: int, desc: str, disable: bool) -> tuple[Any, Callable]:
        bar = tqdm(total=total, desc=desc, disable=disable)

        def update(done: int, _total: int) -> None:
            bar.update(done - bar.n)

        return bar, update

    def _score_tokens(
        self, pairs: list[tuple[list[int], list[int]]], names: list[str], disable_tqdm: bool
    ) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, greedy) per (context ids, continuation ids).
        A pair over the model's maximum is left-truncated as `hf` cuts it (`_fit`)."""
        fitted = [self._fit(c, x, name) for (c, x), name in zip(pairs, names, strict=True)]
        cut = sum(len(a) != len(b) for (a, _), (b, _) in zip(fitted, pairs, strict=True))
        pairs = fitted
        if cut:
            warnings.warn(
                f"logitloop lm-eval backend: {cut} of {len(pairs)} requests were longer than "
                f"max_length {self.max_length} + 1 tokens; their contexts were left-truncated "
                "as the hf backend truncates them",
                stacklevel=3,
            )
        if not pairs:
            return []
        bar, update = self._progress(len(pairs), "Scoring requests", disable_tqdm)
        scored = ll.score(
            self.model, [p[0] for p in pairs], [p[1] for p in pairs],
            mesh=self.mesh, deterministic=self.deterministic, batch_size=self.batch_size,
            **self.adapter,
            progress=update, share_prompts=self.prefix_cache,
        )  # fmt: skip
        bar.close()
        errors = sum(s.error is not None for s in scored)
        if errors:
            warnings.warn(
                f"logitloop lm-eval backend: {errors} of {len(scored)} requests were scored "
                "from logits holding NaN or inf (ll.score's error): their log-likelihood is "
                "-inf",
                stacklevel=3,
            )
        return [(s.raw_logprob_sum, s.is_greedy) for s in scored]

    def _fit(self, ctx: list[int], cont: list[int], name: str) -> tuple[list[int], list[int]]:
        """(context, continuation) ids cut to the model's window as lm-eval's `hf` backend
        cuts them: the last `max_length + 1` tokens of context plus continuation (the last
        one is scored but never fed), so a long context loses its first tokens and its
        scores are `hf`'s. A continuation of more than `max_length` tokens is refused."""
        if not cont:
            raise ValueError(f"{name}: the continuation is empty after tokenization")
        if len(cont) > self.max_length:
            raise ValueError(
                f"{name}: the continuation alone has {len(cont)} tokens, over the model's "
                f"maximum of {self.max_length}; raise max_length or shorten the continuation"
            )
        if len(ctx) + len(cont) - 1 > self.max_length:
            ctx = ctx[len(ctx) + len(cont) - (self.max_length + 1) :]
        return ctx, cont

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str], list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs,
    ) -> list[tuple[float, bool]]:
        names = [f"loglikelihood request {i} ({req[0]!r:.60})" for i, req in enumerate(requests)]
        pairs = [(list(ctx), list(cont)) for _, ctx, cont in requests]
        results = self._score_tokens(pairs, names, disable_tqdm)
        for (key, _, _), answer in zip(requests, results, strict=True):
            # lm-eval's cache (`--use_cache`) keeps every answer: a rerun skips them.
            self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs, owner, names = [], [], []
        for doc, (string,) in enumerate(req.args for req in requests):
            windows = map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            )
            for w, (ctx, pred) in enumerate(windows):
                pairs.append((list(ctx), list(pred)))
                owner.append(doc)
                names.append(f"loglikelihood_rolling document {doc} window {w}")
        results = self._score_tokens(pairs, names, disable_tqdm)
        totals = [0.0] * len(requests)
        for doc, (logprob, _) in zip(owner, results, strict=True):
            totals[doc] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation

    def _sampling(self, gen_kwargs: dict, index: int) -> tuple[dict, list[str]]:
        """`SamplingParams.create` arguments and the stop strings of one request."""
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"generate_until request {index}: gen_kwargs must be a dict")
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        do_sample = kwargs.pop("do_sample", False)
        max_gen_toks = kwargs.pop("max_gen_toks")
        unknown = sorted(set(kwargs) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(
                f"generate_until request {index}: gen_kwargs {', '.join(unknown)} not "
                f"supported by the logitloop backend (supported: until, max_gen_toks, "
                f"do_sample, {', '.join(SAMPLING_KEYS)})"
            )
        params = {k: kwargs[k] for k in SAMPLING_KEYS if kwargs.get(k) is not None}
        if not do_sample:
            params["temperature"] = 0.0  # greedy unless sampling is asked for, as in hf
        params["max_tokens"] = int(max_gen_toks)
        # The decoded continuation is cut at the earliest stop string below (as hf cuts
        # it), so the row keeps the token that completes a stop string.
        params["stop"] = [s for s in until if s]
        params["include_stop_str_in_output"] = True
        return params, until

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        jobs, stops = [], []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            params, until = self._sampling(gen_kwargs, i)
            room = self.max_length - params["max_tokens"]
            if room < 1:
                raise ValueError(
                    f"generate_until request {i}: max_gen_toks {params['max_tokens']} leaves "
                    f"no room for a prompt in the model's maximum of {self.max_length} tokens"
                )
            # hf left-truncates the prompt to max_length - max_gen_toks tokens.
            ids = self.tok_encode(context)[-room:]
            jobs.append(ll.Request(ids, params, id=f"generate_until request {i}"))
            stops.append(until)
        # The job's programs first, at its bounds (`ll.precompile`, with a progress line):
        # every request then runs them.
        bounds = dict(
            max_prompt_len=max(len(job.prompt) for job in jobs),
            max_tokens_bound=max(int(job.params["max_tokens"]) for job in jobs),
        )
        shared = dict(
            slots=self.batch_size, mesh=self.mesh, deterministic=self.deterministic,
            prefix_cache=self.prefix_cache, **self.adapter,
        )  # fmt: skip
        ll.precompile(
            self.model, prompt_len=bounds["max_prompt_len"],
            max_tokens=bounds["max_tokens_bound"], progress=not disable_tqdm, **shared,
        )  # fmt: skip
        bar = tqdm(total=len(jobs), desc="Running generate_until requests", disable=disable_tqdm)
        out: list[Any] = [None] * len(jobs)
        for index, result in ll.iter_generate_many(self.model, jobs, **bounds, **shared):
            out[index] = result
            bar.update(1)
        bar.close()
        texts = []
        for req, result, until in zip(requests, out, stops, strict=True):
            text = self.tok_decode(result.token_ids[0])
            text = postprocess_generated_text(text, until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts
