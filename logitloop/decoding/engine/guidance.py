"""Classifier-free guidance on the host: `guidance_scale=` and `negative_prompt=` checked,
and the batch's negative rows laid out for the loop (`logitloop.decoding.loop.guidance`).

`generate` and `stream` take, as options (`plan.Options`), each prompt's

- `guidance_scale`: a finite number, or None; None and 1 leave the row unguided (as
  transformers adds no guidance at 1: a negative prompt beside 1 is ignored, beside None
  refused), any other value guides it;
- `negative_prompt`: text or token ids, or None: transformers' default, the prompt's last
  token alone (`UnbatchedClassifierFreeGuidanceLogitsProcessor`).

Each takes one value for every prompt or a list with one per prompt (a flat list of ints
is one negative prompt's ids, for every prompt). The negative prompts of the guided
prompts join the batch as extra prompts after the real ones (`with_negatives`), each with
a copy of its prompt's params (so `n` samples each get their own negative row, and a
negative row stops with its row); the results keep the real rows only.
`generate_many` takes the same settings per request, its negative rows in slots of their
own (`job_guidance`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from logitloop.decoding.engine.host import check_context, tokenize_prompt
from logitloop.decoding.loop.guidance import Guidance
from logitloop.decoding.loop.runner import ModelInfo
from logitloop.decoding.sampling.checks import is_token_id, row_name
from logitloop.decoding.sampling.params import SamplingParams
from logitloop.models.kv import Rows

WHERE = "generate, stream and generate_many"  # the entry points that run guidance so far


@dataclasses.dataclass(frozen=True)
class GuidedPrompts:
    """The guided prompts of a batch of `prompts` prompts: their indices, scales and
    negative prompts' ids, in prompt order."""

    prompts: int
    guided: list[int]
    scales: list[float]
    negatives: list[list[int]]

    def with_negatives(
        self, ids: list[list[int]], params: SamplingParams
    ) -> tuple[list[list[int]], SamplingParams]:
        """The batch's prompts and params followed by the negative prompts, each with its
        guided prompt's params (before `n` and the row bucket: `Plan.batch` does those)."""
        rows = list(range(self.prompts)) + self.guided
        return ids + self.negatives, params.broadcast_to(self.prompts).take(rows)

    def with_negatives_steer(self, steer: Any) -> Any:
        """`steer=` (`generate`'s: an `ll.Steer` for every prompt, or one entry per prompt)
        for the prompts of `with_negatives`: each negative prompt steered as its guided
        prompt (its spans counted in its own context: its prompt is the negative prompt)."""
        if not isinstance(steer, (list, tuple)):
            return steer  # None, or one Steer for every row
        if len(steer) != self.prompts:
            raise ValueError(
                f"steer= must be an ll.Steer for every prompt or a list of {self.prompts} "
                f"entries (one per prompt: None, an ll.Steer or a list of them), got a "
                f"{type(steer).__name__} of {len(steer)}"
            )
        return [*steer, *(steer[u] for u in self.guided)]

    def tables(self, n: int, batch_size: int) -> Guidance:
        """The loop's `Guidance` for a batch of `batch_size` rows laid out by `Plan.batch`
        from `with_negatives`: prompt-major, `n` rows a prompt, negative prompt j's rows
        after the real prompts' (prompt `prompts + j`)."""
        scale = np.ones(batch_size, np.float32)
        negative = np.arange(batch_size, dtype=np.int32)
        parent = negative.copy()
        for j, (u, s) in enumerate(zip(self.guided, self.scales, strict=True)):
            for i in range(n):
                row, neg = u * n + i, (self.prompts + j) * n + i
                scale[row], negative[row], parent[neg] = s, neg, row
        return Guidance(*jax.device_put((scale, negative, parent)))


def negative_rows_adapters(rows: Rows | None, guidance: Guidance) -> Rows | None:
    """`rows` (`Plan.adapter_rows` of the real rows) with each negative row under its
    guided row's adapter (the same model makes both scores)."""
    if rows is None or rows.adapter is None:
        return rows
    slots = np.asarray(rows.adapter)[np.asarray(guidance.parent)]
    return rows.replace(adapter=jax.device_put(slots))


def guided_prompts(
    info: ModelInfo, ids: list[list[int]], scale: Any, negative: Any, params: SamplingParams
) -> GuidedPrompts | None:
    """Check `guidance_scale` (`scale`) and `negative_prompt` (`negative`) for the prompts
    `ids` (under `params`: their `max_tokens` for the negative prompts' context); None when no
    prompt is guided. Refused by name, before anything runs: a scale that is not a finite
    number, a negative prompt for a prompt whose scale is None, a per-prompt list of the
    wrong length, a negative prompt that is not text or token ids, or that does not fit
    the context with the row's tokens."""
    count = len(ids)
    if scale is None:
        if negative is not None:
            raise ValueError(
                "negative_prompt= is given without guidance_scale=: pass guidance_scale "
                "(a finite number other than 1) for the prompts it guides"
            )
        return None
    scales = _per_prompt("guidance_scale", scale, count, lambda v: not _is_list(v))
    negatives = _per_prompt("negative_prompt", negative, count, _is_one_prompt)
    # One value given for every prompt is named without an index ("guidance_scale = nan").
    rows = count if _is_list(scale) else 1
    neg_rows = 1 if _is_one_prompt(negative) else count
    max_tokens = np.asarray(params.broadcast_to(count).max_tokens)
    guided, kept, neg_ids = [], [], []
    for u in range(count):
        name = row_name("guidance_scale", u, rows)
        s, neg = scales[u], negatives[u]
        check_scale(name, s)
        if s is None and neg is not None:
            raise ValueError(
                f"{row_name('negative_prompt', u, neg_rows)} is given but {name} is None: the "
                "prompt is not guided (give it a guidance_scale, or no negative prompt)"
            )
        if s is None or float(s) == 1.0:
            continue  # unguided: no negative row (transformers adds no guidance at 1)
        where = row_name("negative_prompt", u, neg_rows)
        neg = ids[u][-1:] if neg is None else tokenize_prompt(where, neg, info)
        check_context(where, neg, int(max_tokens[u]), info, row_name("max_tokens", u, count))
        guided.append(u)
        kept.append(float(np.float32(s)))
        neg_ids.append(neg)
    if not guided:
        return None
    return GuidedPrompts(count, guided, kept, neg_ids)


def check_scale(name: str, scale: Any) -> None:
    """One prompt's guidance scale (`name`): a finite number, or None (unguided)."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.number)):
        raise ValueError(f"{name} must be a finite number or None, got {scale!r}")
    if not math.isfinite(float(scale)):
        raise ValueError(
            f"{name} = {scale!r} is not finite: pass a finite number (1 or None: no guidance)"
        )


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple, np.ndarray))


def _is_one_prompt(value: Any) -> bool:
    """Whether `value` is one negative prompt (text, token ids or None), not one per prompt."""
    return not _is_list(value) or (len(value) > 0 and all(is_token_id(t) for t in value))


def _per_prompt(name: str, value: Any, count: int, is_one) -> list[Any]:
    """`value` for each of `count` prompts: one value repeated, or a list of one per prompt."""
    if is_one(value):
        return [value] * count
    if len(value) != count:
        raise ValueError(
            f"{name} has {len(value)} entries for {count} prompts: give one value for every "
            "prompt or one per prompt"
        )
    return list(value)


def check_supported(options: Any, supported: bool) -> None:
    """Refuse guidance where it does not run yet (`supported` False: an entry point other
    than generate, stream and generate_many), and beside the options it does not combine
    with yet, by name."""
    if options.guidance_scale is None and options.negative_prompt is None:
        return
    if not supported:
        raise NotImplementedError(
            f"guidance_scale= and negative_prompt= run in {WHERE} so far, not here yet "
            "(docs/guidance.md)"
        )
    for option in ("speculative", "mesh"):
        if getattr(options, option) is not None:
            raise NotImplementedError(
                f"guidance_scale= does not run with {option}= yet (docs/guidance.md)"
            )
