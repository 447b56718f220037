"""Decode-loop benchmark: `generate` against the model's own cost, a Python loop and a peer.

    python scripts/bench_generate.py                       # loop overhead (floor, Python loop)
    python scripts/bench_generate.py --peer transformers   # also transformers.generate, on CPU
    python scripts/bench_generate.py --out bench_out/generate.json
    python scripts/bench_generate.py --skip-overhead --buffers 192 1088 2112

Part 1, loop overhead, on the same model and batch, in one run:
- `generate`: `logitloop.generate` (prefill + one `lax.while_loop`), sampling included.
- `floor`: the same prefill and number of forward steps with argmax in a `lax.scan`: the
  model's own cost, with nothing of logitloop's sampler or stop bookkeeping.
- `python loop`: a Python loop that calls a jitted single step (forward + `logitloop.sample`).
Run on a ~40M-parameter Llama (batch 8) and on a tiny one where dispatch dominates.

Part 2 (`--peer transformers`): the same ~40M-parameter Llama checkpoint, written by
`transformers` and loaded by logitloop, generating 128 tokens from 64-token prompts at batch 1
and 8, greedy and top-p 0.9, in logitloop and in `transformers`' `generate` (PyTorch CPU);
then a Gemma 3 and a Mixtral of about the same size (`PEER_FAMILIES`, `--peer-models`).
The two alternate, repeat by repeat (median of each).
Compile time is reported separately; tokens per second exclude it. `matmul floor` is the
time of one decode step's matrix products alone (every weight matrix times a [batch, in]
activation, each product feeding the next) in XLA and in PyTorch, and `matmul-bound tok/s`
the tokens per second those products allow each library: neither can decode faster.

Part 3 (`--buffers S ...`): the cost of a KV cache sized for long outputs while the rows
are still short: the floor's 128 steps (batch 8, prompt 64, llama-40m) with caches of S
slots, against the smallest S. A decode step reads only the prefix of the cache that
holds every visible slot (`logitloop.ops.attention.api.decode_attention`), so the ratio
should stay near 1.

Part 4 (`--deterministic`): `generate(..., deterministic=True)` and
`deterministic="model-parallel"` against the default at batch 1 and 8 (greedy, prompt
`--prompt`, `--new-tokens` new), on llama-40m and on the shipped model in its own
bfloat16; the three modes alternate, repeat by repeat, and the table gives the median
tokens per second of each and the two ratios to the default.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import first_call, median_time  # scripts/ is on the path when run as a script

import logitloop as ll
from logitloop.decoding.loop.runner import model_info
from logitloop.models import LlamaConfig, LlamaModel

MODELS = {
    # ~41.7M parameters with tied embeddings.
    "llama-40m": dict(hidden=512, layers=8, heads=8, kv_heads=8, ffn=1376, vocab=32000),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512),
    # Llama 3.2 1B's shapes (tied embeddings): ~1.24B parameters.
    "llama-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),
}


def config(name: str, context: int = 1024) -> LlamaConfig:
    m = MODELS[name]
    return LlamaConfig(
        vocab_size=m["vocab"],
        hidden_size=m["hidden"],
        intermediate_size=m["ffn"],
        num_layers=m["layers"],
        num_heads=m["heads"],
        num_kv_heads=m["kv_heads"],
        head_dim=m["hidden"] // m["heads"],
        max_position_embeddings=context,
        tie_word_embeddings=True,
    )


@functools.partial(jax.jit, static_argnames=("runner", "steps", "cache_len"))
def scan_floor(runner, weights, prompt, positions, lens, *, steps, cache_len):
    """Prefill, then `steps` forward passes with argmax: the model's own cost."""
    batch = prompt.shape[0]
    cache = runner.init_cache(weights, batch, cache_len)
    logits, cache = runner.forward(weights, prompt, positions, cache)

    def step(carry, i):
        logits, cache = carry
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits, cache = runner.forward(weights, tok[:, None], (lens + i)[:, None], cache)
        return (logits, cache), tok

    (_, _), toks = jax.lax.scan(step, (logits, cache), jnp.arange(steps))
    return toks


def floor_run(info, prompt, positions, lens, steps: int, cache_len: int):
    """`scan_floor` on the model of `info`, as a function of no arguments."""
    return functools.partial(
        scan_floor,
        info.runner,
        info.weights,
        prompt,
        positions,
        lens,
        steps=steps,
        cache_len=cache_len,
    )


@functools.partial(jax.jit, static_argnames=("runner",), donate_argnames=("cache",))
def single_step(runner, weights, tok, pos, cache, params, index):
    logits, cache = runner.forward(weights, tok[:, None], pos[:, None], cache)
    out = ll.sample(logits, params, index)
    return out.tokens, cache


def python_loop(info, prompt, positions, lens, params, steps, cache_len):
    cache = info.runner.init_cache(info.weights, prompt.shape[0], cache_len)
    logits, cache = jax.jit(info.runner.forward)(info.weights, prompt, positions, cache)
    tok = ll.sample(logits, params, jnp.zeros_like(lens)).tokens
    for i in range(steps):
        tok, cache = single_step(
            info.runner, info.weights, tok, lens + i, cache, params, jnp.full_like(lens, i + 1)
        )
    return tok


def loop_overhead(name: str, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    model = LlamaModel(config(name), rngs=nnx.Rngs(0))
    info = model_info(model)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, info.vocab_size, (batch, prompt_len)).tolist()
    params = ll.SamplingParams.create(batch_size=batch, temperature=0.0, max_tokens=new_tokens)
    run_generate = lambda: ll.generate(model, prompts, params, ignore_eos=True).token_ids  # noqa: E731

    # The same padded shapes generate uses.
    plen = ll.decoding.generate.bucket(prompt_len, ll.decoding.generate.MIN_PROMPT_BUCKET)
    buf = ll.decoding.generate.bucket(new_tokens, ll.decoding.generate.MIN_BUFFER_BUCKET)
    prompt = np.zeros((batch, plen), np.int32)
    positions = np.full((batch, plen), -1, np.int32)
    prompt[:, plen - prompt_len :] = prompts
    positions[:, plen - prompt_len :] = np.arange(prompt_len)
    prompt, positions = jnp.asarray(prompt), jnp.asarray(positions)
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    run_floor = floor_run(info, prompt, positions, lens, new_tokens - 1, plen + buf)
    dev_params = params.device_only()
    run_loop = lambda: python_loop(  # noqa: E731
        info, prompt, positions, lens, dev_params, new_tokens - 1, plen + buf
    )
    out = {"model": name, "batch": batch, "prompt": prompt_len, "new_tokens": new_tokens}
    for label, fn in (("generate", run_generate), ("floor", run_floor), ("python loop", run_loop)):
        out[label + " compile+first"] = first_call(fn)
        out[label] = median_time(fn, repeats)
    # Same tokens from all three (greedy), as a sanity check of the comparison.
    toks = np.asarray(ll.generate(model, prompts, params, ignore_eos=True).token_ids)
    # The scan's step i emits the argmax of the logits it was handed: the first token is
    # the prefill's, so its new_tokens - 1 outputs are generate's first new_tokens - 1.
    floor_toks = np.asarray(run_floor()).T  # [B, new_tokens - 1]
    toks = toks[:, : floor_toks.shape[1]]
    out["same_tokens_as_floor"] = bool((toks == floor_toks).all())
    return out


def matmul_floor(model, hf, batch: int, repeats: int) -> tuple[float, float]:
    """Seconds per decode step spent in the model's matrix products alone, at `batch` rows.

    Every weight matrix of the model (attention, MLP, LM head) multiplies a [batch, in]
    activation once, as one decode step does, and each product feeds the next (as in a
    step, where no layer can start before the one below it ends): in XLA, 16 such steps
    in a `lax.fori_loop` (the logitloop weights), and in PyTorch with `F.linear` (the
    transformers weights). No attention, norms or sampling: a lower bound on a step for
    either library on this machine.
    """
    import torch

    weights = [
        w.reshape(w.shape[0], -1)
        if w.ndim == 3 and w.shape[0] == model.config.hidden_size
        else w.reshape(-1, w.shape[-1])
        for w in jax.tree.leaves(nnx.state(model, nnx.Param))
        if w.ndim >= 2
    ]
    # The tied embedding serves as the LM head ([V, E], contracted on E).
    head = model.embedding[...]
    weights = [w for w in weights if w.shape != head.shape]
    widths = sorted({w.shape[0] for w in weights} | {w.shape[1] for w in weights})
    steps = 16

    def chain(acts, ws, product):
        # Each product reads the activation of its input width as the previous products
        # left it and adds into that of its output width: one dependent chain per step.
        acts = dict(acts)
        for w, (n_in, n_out) in ws:
            acts[n_out] = acts[n_out] + 1e-3 * product(acts[n_in], w)
        return acts

    @jax.jit
    def products(weights, head, acts):
        ws = [(w, w.shape) for w in weights]

        def step(_, acts):
            acts = chain(acts, ws, jnp.matmul)
            logits = acts[head.shape[1]] @ head.T
            acts[head.shape[1]] = acts[head.shape[1]] + 1e-3 * logits[:, : head.shape[1]]
            return acts

        return jax.lax.fori_loop(0, steps, step, acts)

    rng = np.random.default_rng(0)
    acts = {n: jnp.asarray(rng.standard_normal((batch, n)), jnp.float32) for n in widths}
    t_xla = median_time(lambda: products(weights, head, acts), max(repeats, 5), warmup=1) / steps

    linears = [m.weight.detach() for m in hf.modules() if isinstance(m, torch.nn.Linear)]
    t_ws = [(w, (w.shape[1], w.shape[0])) for w in linears]  # F.linear: [out, in]
    t_acts = {n: torch.randn(batch, n) for n in {s for _, io in t_ws for s in io}}

    def torch_products():
        with torch.inference_mode():
            acts = t_acts
            for _ in range(steps):
                acts = chain(acts, t_ws, torch.nn.functional.linear)
            return float(sum(a.sum() for a in acts.values()))

    return t_xla, median_time(torch_products, max(repeats, 5), warmup=1) / steps


def transformers_llama(c: dict, *, tie_word_embeddings: bool = True):
    """A randomly initialised `transformers` Llama (seed 0) with the sizes in `c`."""
    import torch
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        intermediate_size=c["ffn"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(hf_config).eval()


# Other families at about llama-40m's size (hidden 512, 8 layers, vocab 32000, tied):
# (transformers config class, causal-LM class, config fields).
_SIZES_40M = dict(
    vocab_size=32000,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
PEER_FAMILIES = {
    # Gemma 3: 5 local layers (window 64, shorter than prompt + output: a ring of 72
    # slots) to 1 global, QK-norm, GeGLU; head_dim 64, 4 kv heads; ~42M parameters.
    "gemma3-40m": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            _SIZES_40M,
            intermediate_size=1376,
            num_key_value_heads=4,
            head_dim=64,
            sliding_window=64,
            query_pre_attn_scalar=64,
        ),
    ),
    # Mixtral: 8 experts of width 172, top-2, on every layer: the total parameters of
    # llama-40m (~42M), a quarter of its MLP work per token.
    "mixtral-40m": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            _SIZES_40M,
            intermediate_size=172,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    ),
}


def transformers_model(name: str):
    """The randomly initialised `transformers` model (seed 0) named `name`."""
    import torch
    import transformers

    if name == "llama-40m":
        return transformers_llama(MODELS[name])
    config_cls, model_cls, fields = PEER_FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**fields)
    return getattr(transformers, model_cls)(config).eval()


def peer_pair(name: str):
    """The `transformers` model `name` (`transformers_model`) and logitloop's float32 load of
    the same checkpoint, saved to a temporary folder: the two sides of a peer benchmark."""
    hf = transformers_model(name)
    folder = Path(tempfile.mkdtemp()) / name
    hf.save_pretrained(folder)
    return hf, ll.load_pretrained(folder, dtype=jnp.float32)


def peer_transformers(
    batch_sizes, prompt_len, new_tokens, repeats, threads, models=("llama-40m",)
) -> list[dict]:
    rows = []
    for name in models:
        rows += _peer_one(name, batch_sizes, prompt_len, new_tokens, repeats, threads)
    return rows


def _peer_one(name, batch_sizes, prompt_len, new_tokens, repeats, threads) -> list[dict]:
    import torch

    torch.set_num_threads(threads)
    hf, model = peer_pair(name)
    vocab = hf.config.vocab_size
    n_params = sum(p.numel() for p in hf.parameters())
    rows = []
    for batch in batch_sizes:
        rng = np.random.default_rng(batch)
        prompts = rng.integers(1, vocab, (batch, prompt_len))
        for mode in ("greedy", "top-p 0.9"):
            greedy = mode == "greedy"
            params = ll.SamplingParams.create(
                batch_size=batch,
                temperature=0.0 if greedy else 1.0,
                top_p=1.0 if greedy else 0.9,
                max_tokens=new_tokens,
                seed=list(range(batch)),
            )
            ours = functools.partial(ll.generate, model, prompts.tolist(), params, ignore_eos=True)
            compile_s = first_call(lambda: ours().token_ids)  # noqa: B023 (called at once)
            ids = torch.tensor(prompts)
            kwargs = dict(
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=not greedy,
                top_p=None if greedy else 0.9,
                top_k=None,
                temperature=None if greedy else 1.0,
                attention_mask=torch.ones_like(ids),
                pad_token_id=0,
            )
            theirs = functools.partial(hf.generate, ids, **kwargs)
            with torch.inference_mode():
                theirs()  # warm-up
                # Alternate the two, so that both see the same state of the shared machine.
                times = [
                    (first_call(lambda: ours().token_ids), first_call(theirs))  # noqa: B023
                    for _ in range(repeats)
                ]
            t_ours = statistics.median(t for t, _ in times)
            t_hf = statistics.median(t for _, t in times)
            if greedy:
                with torch.inference_mode():
                    ref = hf.generate(ids, **kwargs)[:, prompt_len:].numpy()
                same = float((np.asarray(ours().token_ids) == ref).mean())
            else:
                same = float("nan")
            tokens = batch * new_tokens
            floor_xla = floor_torch = float("nan")
            if greedy and name == "llama-40m":  # the chained products assume Llama's layout
                floor_xla, floor_torch = matmul_floor(model, hf, batch, repeats)
            rows.append(
                {
                    "model": name,
                    "batch": batch,
                    "mode": mode,
                    "params": int(n_params),
                    "logitloop tok/s": tokens / t_ours,
                    "transformers tok/s": tokens / t_hf,
                    "speedup": t_hf / t_ours,
                    "logitloop compile s": compile_s,
                    "greedy token agreement": same,
                    # The matrix products of one step alone, and the tokens/s they allow.
                    "matmul floor ms (xla)": floor_xla * 1e3,
                    "matmul floor ms (torch)": floor_torch * 1e3,
                    "matmul-bound tok/s (xla)": batch / floor_xla,
                    "matmul-bound tok/s (torch)": batch / floor_torch,
                }
            )
    return rows


def long_buffers(buffers: list[int], repeats: int) -> list[dict]:
    """Seconds for prefill + 127 greedy steps of llama-40m at batch 8 with S-slot caches."""
    model = LlamaModel(config("llama-40m", context=max(buffers)), rngs=nnx.Rngs(0))
    info = model_info(model)
    batch, prompt_len = 8, 64
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, info.vocab_size, (batch, prompt_len)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), prompt.shape)
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    rows, tokens = [], {}
    for slots in buffers:
        run = floor_run(info, prompt, positions, lens, 127, slots)
        tokens[slots] = np.asarray(run())
        rows.append({"slots": slots, "seconds": median_time(run, repeats)})
    for r in rows:
        r["vs smallest"] = r["seconds"] / rows[0]["seconds"]
        r["same tokens"] = bool((tokens[r["slots"]] == tokens[buffers[0]]).all())
    return rows


def mode_rates(model, prompts, new_tokens: int, repeats: int, modes) -> tuple[dict, dict, bool]:
    """Greedy `generate` under each `deterministic=` value of `modes` (the first is the
    baseline), alternating, repeat by repeat: the median tokens per second of each, the
    seconds of each one's first call (compilation included), and whether every mode's
    tokens equal the first's."""
    batch = len(prompts)
    params = ll.SamplingParams.create(batch_size=batch, temperature=0.0, max_tokens=new_tokens)

    def run(det):
        return ll.generate(model, prompts, params, ignore_eos=True, deterministic=det)

    compile_s = {det: first_call(lambda det=det: run(det).num_tokens) for det in modes}
    times = {det: [] for det in modes}
    for _ in range(repeats):
        for det in modes:
            times[det].append(first_call(lambda det=det: run(det).num_tokens))
    rate = {det: batch * new_tokens / statistics.median(t) for det, t in times.items()}
    first = run(modes[0]).token_ids
    same = all(run(det).token_ids == first for det in modes[1:])
    return rate, compile_s, same


def deterministic_cost(prompt_len: int, new_tokens: int, repeats: int) -> list[dict]:
    """Tokens per second of deterministic and default `generate`, alternating."""
    rows = []
    models = {
        "llama-40m": LlamaModel(config("llama-40m"), rngs=nnx.Rngs(0)),
        "shipped bf16": ll.load_pretrained(),
    }
    for name, model in models.items():
        vocab = model.config.vocab_size
        for batch in (1, 8):
            rng = np.random.default_rng(batch)
            prompts = rng.integers(1, vocab, (batch, prompt_len)).tolist()
            modes = (False, True, "model-parallel")
            rate, compile_s, same = mode_rates(model, prompts, new_tokens, repeats, modes)
            rows.append(
                {
                    "model": name,
                    "batch": batch,
                    "default tok/s": rate[False],
                    "deterministic tok/s": rate[True],
                    "ratio": rate[True] / rate[False],
                    "model-parallel tok/s": rate["model-parallel"],
                    "model-parallel ratio": rate["model-parallel"] / rate[False],
                    "compile+first s (default, deterministic, model-parallel)": [
                        compile_s[det] for det in modes
                    ],
                    "greedy tokens equal the default's": same,
                }
            )
            print(
                f"{name:>12} {batch:>5} {rate[False]:>13.1f} {rate[True]:>19.1f} "
                f"{rate[True] / rate[False]:>6.2f} {rate['model-parallel']:>8.1f} "
                f"{rate['model-parallel'] / rate[False]:>6.2f} "
                f"{'/'.join(f'{compile_s[d]:.1f}' for d in modes):>15} {same}",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", choices=["transformers"], default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the peer")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--buffers", type=int, nargs="*", default=[], help="cache sizes (part 3)")
    ap.add_argument(
        "--peer-models",
        nargs="*",
        default=["llama-40m", *PEER_FAMILIES],
        choices=["llama-40m", *PEER_FAMILIES],
        help="models for --peer (default: all)",
    )
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic=True and 'model-parallel' against the default",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report: dict = {"jax": jax.__version__}
    if not args.skip_overhead:
        report["overhead"] = []
        print(
            f"{'model':>10} {'batch':>5} {'generate s':>10} {'floor s':>8} {'python s':>9} "
            f"{'gen/floor':>9} {'python/gen':>10} same"
        )
        for name, batch in (("llama-40m", 8), ("tiny", 8), ("tiny", 1)):
            r = loop_overhead(name, batch, args.prompt, args.new_tokens, args.repeats)
            report["overhead"].append(r)
            print(
                f"{name:>10} {batch:>5} {r['generate']:>10.3f} {r['floor']:>8.3f} "
                f"{r['python loop']:>9.3f} {r['generate'] / r['floor']:>9.2f} "
                f"{r['python loop'] / r['generate']:>10.2f} {r['same_tokens_as_floor']}",
                flush=True,
            )
    if args.peer == "transformers":
        rows = peer_transformers(
            [1, 8], args.prompt, args.new_tokens, args.repeats, args.threads, args.peer_models
        )
        report["transformers"] = rows
        print(
            f"{'model':>11} {'batch':>5} {'mode':>10} {'logitloop tok/s':>15} "
            f"{'transformers tok/s':>18} "
            f"{'speedup':>7} {'compile s':>9} {'greedy agree':>12} {'matmul ms xla/torch':>19} "
            f"{'matmul-bound tok/s xla/torch':>28}"
        )
        for r in rows:
            print(
                f"{r['model']:>11} {r['batch']:>5} {r['mode']:>10} {r['logitloop tok/s']:>15.1f} "
                f"{r['transformers tok/s']:>18.1f} {r['speedup']:>7.2f} "
                f"{r['logitloop compile s']:>9.1f} {r['greedy token agreement']:>12.3f} "
                f"{r['matmul floor ms (xla)']:>9.2f}/{r['matmul floor ms (torch)']:<9.2f} "
                f"{r['matmul-bound tok/s (xla)']:>13.1f}/{r['matmul-bound tok/s (torch)']:<14.1f}"
            )
    if args.buffers:
        rows = long_buffers(sorted(args.buffers), args.repeats)
        report["buffers"] = rows
        print(f"{'slots':>6} {'seconds':>8} {'vs smallest':>11} same tokens")
        for r in rows:
            print(
                f"{r['slots']:>6} {r['seconds']:>8.3f} {r['vs smallest']:>11.2f} {r['same tokens']}"
            )
    if args.deterministic:
        print(
            f"{'model':>12} {'batch':>5} {'default tok/s':>13} {'deterministic tok/s':>19} "
            f"{'ratio':>6} {'mp tok/s':>8} {'ratio':>6} {'compile s':>15} same tokens"
        )
        report["deterministic"] = deterministic_cost(args.prompt, args.new_tokens, args.repeats)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
