"""Random rows for the processor tests: histories that repeat themselves, and one jitted apply."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.processors import Step


def repetitive_tokens(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    """Tokens with plenty of repeated n-grams: a small alphabet, and copies of earlier spans."""
    alphabet = rng.choice(vocab, size=int(rng.integers(2, 6)), replace=False)
    tail = min(int(rng.integers(2, 8)), length // 2)  # the row ends repeating itself
    out: list[int] = []
    while len(out) < length - tail:
        if len(out) > 3 and rng.random() < 0.4:  # copy an earlier span
            a = int(rng.integers(0, len(out) - 1))
            out.extend(out[a : a + int(rng.integers(2, 8))])
        else:
            out.append(int(rng.choice(alphabet)))
    out = out[: length - tail]
    a = int(rng.integers(0, len(out) - tail + 1)) if tail else 0
    return out + out[a : a + tail]


def make_history(rows: list[list[int]], num_prompt: list[int], capacity: int) -> History:
    """A History holding `rows[r]` (its first `num_prompt[r]` tokens the prompt)."""
    buf = np.full((len(rows), capacity), -1, np.int32)
    for r, toks in enumerate(rows):
        buf[r, : len(toks)] = toks
    return History(
        tokens=jnp.asarray(buf),
        num_prompt=jnp.asarray(num_prompt, jnp.int32),
        length=jnp.asarray([len(t) for t in rows], jnp.int32),
    )


def random_rows(
    rng: np.random.Generator, batch: int, vocab: int, capacity: int
) -> tuple[list[list[int]], list[int]]:
    """Per-row tokens of random lengths (0 and 1 included), and random prompt lengths."""
    lengths = [0, 1] + [int(rng.integers(2, capacity + 1)) for _ in range(batch - 2)]
    rows = [repetitive_tokens(rng, n, vocab) for n in lengths]
    num_prompt = [int(rng.integers(0, n + 1)) for n in lengths]
    return rows, num_prompt


@jax.jit
def apply_jit(processor, logits: jax.Array, history: History) -> jax.Array:
    """`processor.apply` under jit: the processor's settings are traced leaves."""
    batch, vocab = logits.shape
    step = Step(
        positions=history.length - history.num_prompt,
        history=history,
        done=jnp.zeros((batch,), bool),
    )
    return processor.apply(processor.init(batch, vocab), logits, step)


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """float32 arrays identical bit for bit (an off row must pass its logits through)."""
    a = np.asarray(actual, np.float32).view(np.uint32)
    e = np.asarray(expected, np.float32).view(np.uint32)
    assert np.array_equal(a, e), f"{what}: differs at {np.argwhere(a != e)[:5].tolist()}"
