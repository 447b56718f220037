"""How far a quantized model's next-token distributions are from its float model's.

`compare(reference, candidate, tokens)` runs both models teacher-forced over the same token
windows (every position sees the true text before it, so one early difference does not
derail the rest) and reports, over every position of every window:

- `agreement`: the fraction of positions where both argmaxes are the same token (greedy
  agreement, teacher-forced),
- `kl`: the mean KL(reference || candidate) of the next-token distributions, in nats,
  computed in float64,
- `ppl_reference`, `ppl_candidate`: the perplexity of each on the windows' next tokens, and
  `ppl_ratio` (candidate / reference),
- `entropy_fraction`: the reference's mean entropy over log(vocab): near 1 the
  distributions are near uniform (random weights), and agreement of the argmax means little.

`scripts/bench_quant_accuracy.py` reports these for the shipped model and each family.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def all_logits(model: Any):
    """`logits(tokens [B, T]) -> [B, T, V]` float32, the model's own forward pass over every
    column (`all_columns=True`), compiled once per shape."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens):
        module = nnx.merge(graphdef, state)
        batch, length = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        cache = module.init_cache(batch, length)
        return module(tokens, positions, cache, all_columns=True)[0]

    return lambda tokens: run(state, jnp.asarray(tokens, jnp.int32))


def _log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(reference: Any, candidate: Any, tokens: Any, *, batch_size: int = 16) -> dict:
    """The metrics above over `tokens` `[N, T + 1]` (each window's first T tokens are the
    input, its last T the targets)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [N, T + 1] with T >= 1, got shape {tokens.shape}")
    ref_logits, cand_logits = all_logits(reference), all_logits(candidate)
    agree, kl, nll_ref, nll_cand, entropy = [], [], [], [], []
    for start in range(0, len(tokens), batch_size):
        window = tokens[start : start + batch_size]
        inputs, targets = window[:, :-1], window[:, 1:]
        p = _log_softmax(ref_logits(inputs))
        q = _log_softmax(cand_logits(inputs))
        agree.append(p.argmax(-1) == q.argmax(-1))
        kl.append((np.exp(p) * (p - q)).sum(-1))
        nll_ref.append(-np.take_along_axis(p, targets[..., None], -1)[..., 0])
        nll_cand.append(-np.take_along_axis(q, targets[..., None], -1)[..., 0])
        entropy.append(-(np.exp(p) * p).sum(-1))
    ppl_ref = float(np.exp(np.mean(np.concatenate(nll_ref))))
    ppl_cand = float(np.exp(np.mean(np.concatenate(nll_cand))))
    return {
        "agreement": float(np.mean(np.concatenate(agree))),
        "kl": float(np.mean(np.concatenate(kl))),
        "ppl_reference": ppl_ref,
        "ppl_candidate": ppl_cand,
        "ppl_ratio": ppl_cand / ppl_ref,
        "entropy_fraction": float(np.mean(np.concatenate(entropy)) / np.log(p.shape[-1])),
    }
