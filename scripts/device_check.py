"""One device check: the accelerator claims of logitloop, measured in about four minutes.

    python scripts/device_check.py                     # on a GPU or TPU machine
    python scripts/device_check.py --out device_check.md --budget-s 240
    python scripts/device_check.py --sections decode prefill
    python scripts/device_check.py --smoke             # tiny shapes on a CPU (kernels interpreted)

One process; the sections below, in this order (by value), each time-boxed: it gets its
share of `--budget-s` (by its estimate; what an earlier section left unused goes to the
later ones), stops when that runs out and says so in its row, and the script goes on. Each
section prints one Markdown table row when done and appends it to `--out` at once, so a
run cut short still leaves what it finished. Compilation counts: the estimates (H200, full
shapes, compilation included) are in `ESTIMATE_S`.

1. environment: jax/jaxlib, device kind and memory, the bandwidth the floors use (the
   device's HBM bandwidth from `HBM_BANDWIDTH`, else a copy measured here), the sampling
   implementation `auto` picks, the deterministic mode's product kernel, and the attention
   implementation as `model_info` reports it.
2. sampling: the Pallas kernel and the XLA path at V = 128256, B = 1, 64, 256, a different
   setting in every row (`bench_gpu_sampler`), against the floor (one read of the float32
   logits); the kernel's tokens, kept sets and log-probs against the XLA path's.
3. decode: `generate` tokens/s on a random ~1.24B-parameter bfloat16 Llama (Llama 3.2 1B's
   shapes) at batch 1, 8, 64 against the floor (weights + live KV bytes per step /
   bandwidth); a step's time is the difference of two runs of 256 and 129 new tokens (one
   compiled program), so prefill and dispatch cancel out.
4. prefill: one 32K-token prompt through that model in one pass: XLA's memory analysis of
   the program, then (if it fits) its time and the device's peak memory.
5. deterministic: `deterministic=True` (the Pallas tile kernel on a GPU) against the default
   at batch 1 and 8, and a row's tokens and raw log-probs alone against the same row among
   8, bit for bit (the default mode's answer beside it).
6. speculative: prompt lookup on the same model at batch 1 (never switched off): a
   propose-verify cycle's cost in plain steps and tokens/s at T = 0 and 1; then tokens/s
   of plain and prompt lookup on the copy-heavy task (the shipped model) at T = 0 and 1.
7. paged: the paged decode-attention kernel against its reference
   (`logitloop/ops/attention/paged.py`), and `generate_many` with a paged KV cache on
   shared prefixes, where they have landed; otherwise the row says "not landed".
8. quantized: the decode model's weights as Qwix int8 (per channel) and int4 (groups of
   128): weight bytes, and decode tokens/s at batch 1 and 8 against bfloat16 (the same
   step measurement as decode); "not landed" without the extra `quant`.

`--smoke` runs every section at tiny shapes on a CPU in well under 90 s; the default test
suite runs it (tests/scripts/test_device_check.py). Exit status: 0, or 1 when a check
failed or a section raised, or 2 with no accelerator outside `--smoke`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import os
import platform
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from device_kit import (  # noqa: F401 - re-exported: the tests read them here
    COMPILE_CACHE,
    FULL,
    HBM_BANDWIDTH,
    SMOKE,
    SMOKE_XLA_FLAGS,
    TABLE_HEAD,
    Check,
    OutOfTime,
    Row,
    Shapes,
    gib,
    hbm_bandwidth,
    nbytes,
)
from flax import nnx
from timing import first_call, median_time  # scripts/ is on the path when run as a script

import logitloop as ll
from logitloop.decoding.loop.decode_loop import forward_prompt
from logitloop.decoding.loop.runner import model_info
from logitloop.ops.sampling import dispatch

SECTIONS = (
    "environment", "sampling", "decode", "prefill", "deterministic", "speculative", "paged",
    "quantized",
)  # fmt: skip
# Seconds per section on an H200 at full shapes, compilation included (about 4 minutes):
ESTIMATE_S = dict(
    environment=10,  # backend start, a 1 GiB copy, a tiny model's model_info
    sampling=25,  # 3 kernel + 3 XLA compiles, 20 timed calls each, a NumPy comparison
    decode=70,  # random 1.24B init; 3 x (prefill + loop compile ~15 s); 3 x 6 runs
    prefill=25,  # one 32K-token prompt pass compiled (~15 s), run once if it fits
    deterministic=50,  # 2 x tile-kernel programs (~20 s each); 3 repeats of 129 tokens
    speculative=40,  # the 1B verify program (~20 s); the shipped model's two programs
    paged=15,  # the paged kernel and its reference at one decode shape
    quantized=60,  # 2 quantizations of the 1B model; 2 formats x 2 batches of decode
)

# ----------------------------------------------------------------------------- sections


def environment(ck: Check, row: Row) -> None:
    import jaxlib  # noqa: PLC0415

    dev = ck.device
    row.setup = f"{len(jax.devices())} x {dev.device_kind} ({ck.backend})"
    row.add(
        f"python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}"
    )
    mem = ck.memory()
    row.add(f"memory {gib(mem['bytes_limit'])}" if "bytes_limit" in mem else "memory: not reported")
    bw, source = ck.floor_bandwidth()
    row.add(f"floor bandwidth {bw / 1e9:.3g} GB/s ({source})")
    row.add(f"sampling auto -> {dispatch.resolve_backend('auto')}")
    row.add(
        "deterministic products -> "
        f"{deterministic_kernel(ck, ck.model('tiny')) or 'XLA dots in fixed tiles'}"
    )
    row.add(f"attention -> {attention_choice(model_info(ck.model('tiny')))}")
    cache = jax.config.jax_compilation_cache_dir
    row.add(f"compile cache {cache}" if cache else "no compile cache")
    if not ck.smoke and ck.backend == "cpu":
        row.fail("no accelerator: jax runs on its CPU backend (run --smoke here)")


def attention_choice(info) -> str:
    """The attention implementation `model_info` reports (a field named for it on the info
    or its runner), or what the models do while it reports none."""
    for obj in (info, info.runner):
        for field in dataclasses.fields(obj):
            if "attention" in field.name:
                return f"{field.name} = {getattr(obj, field.name)!r}"
    return "one einsum per layer (model_info reports no attention choice yet)"


def sampling(ck: Check, row: Row) -> None:
    import bench_gpu_sampler as bgs  # noqa: PLC0415 - a sibling script

    s = ck.shapes
    bw, _ = ck.floor_bandwidth()
    # The Triton kernel runs on a GPU, and interpreted on the CPU of a smoke run; a TPU
    # samples with the XLA path (`auto`), so only that is timed there.
    kernel = ck.backend in ("gpu", "cpu")
    row.setup = f"V={s.vocab} f32, B={'/'.join(map(str, s.sampling_batches))}, mixed rows"
    if not kernel:
        row.add("kernel: n/a on TPU (a Triton kernel)")
    for batch in s.sampling_batches:
        ck.check_time()
        r = bgs.time_batch(batch, s.vocab, s.repeats, bw, kernel=kernel, interpret=ck.interpret)
        text = f"B={batch}: xla {r['xla_s'] * 1e6:.0f} us"
        if kernel:
            k = r["kernel_s"]
            text += f", kernel {k * 1e6:.0f} us (xla / kernel {r['xla_s'] / k:.2f})"
        text += f", floor {r['floor_s'] * 1e6:.1f} us"
        if kernel:
            text += f" (kernel {k / r['floor_s']:.1f}x floor)"
        row.add(text)
        if kernel:
            bad = bgs.compare(bgs.inputs(batch, s.vocab, seed=1), interpret=ck.interpret)
            if bad["token_mismatches"] or bad["kept_set_mismatches"]:
                row.fail(f"B={batch}: kernel differs from xla: {bad}")
            elif not bad["max_logprob_error"] <= 1e-5:
                row.fail(f"B={batch}: logprob error {bad['max_logprob_error']:.1e} > 1e-5")
    if kernel and row.status == "ok":
        row.add("kernel = xla: tokens, kept sets, logprobs within 1e-5")


def decode_step(ck: Check, model, prompts: list[list[int]]) -> tuple[float, float, str | None]:
    """(seconds per decode step, compile + first call, a failure or None): `generate`'s
    greedy runs of `new_tokens` and `new_tokens // 2 + 1` tokens (one compiled program),
    median of each, their difference per token (prefill and dispatch cancel out)."""
    s = ck.shapes
    short = s.new_tokens // 2 + 1

    def run(tokens):
        params = ll.SamplingParams.create(
            batch_size=len(prompts), temperature=0.0, max_tokens=tokens
        )
        return ll.generate(model, prompts, params, ignore_eos=True)

    compile_s = first_call(lambda: run(s.new_tokens).num_tokens)
    ended = run(short).finish_reason
    failure = None if set(ended) == {"length"} else f"a row ended early: {ended}"
    times = {s.new_tokens: [], short: []}
    for _ in range(s.repeats if ck.smoke else 3):
        for tokens in times:
            times[tokens].append(first_call(lambda t=tokens: run(t).num_tokens))
    long_s, short_s = (statistics.median(t) for t in times.values())
    return (long_s - short_s) / (s.new_tokens - short), compile_s, failure


def decode(ck: Check, row: Row) -> None:
    s = ck.shapes
    model = ck.model()
    info = model_info(model)
    weights = nbytes(info.weights)
    bw, _ = ck.floor_bandwidth()
    short = s.new_tokens // 2 + 1
    row.setup = (
        f"{s.model} bf16 ({weights / 2 / 1e9:.2f}B), prompt {s.prompt}, "
        f"step = runs of {s.new_tokens} - {short} tokens"
    )
    rng = np.random.default_rng(0)
    for batch in s.decode_batches:
        ck.check_time()
        prompts = rng.integers(1, info.vocab_size, (batch, s.prompt)).tolist()
        step, compile_s, failure = decode_step(ck, model, prompts)
        if failure:
            row.fail(f"B={batch}: {failure}")
        # The floor: every weight and each row's live keys and values, read once a step.
        live = s.prompt + (s.new_tokens + short) / 2
        floor = (weights + batch * live * kv_bytes_per_slot(info)) / bw
        text = f"B={batch}: floor {floor * 1e3:.2f} ms/step, "
        if step > 0:
            text += f"step {step * 1e3:.2f} ms ({floor / step:.0%} of it), {batch / step:.0f} tok/s"
        else:
            text += "step below the timing noise"
        row.add(f"{text}, compile+first {compile_s:.0f} s")


def quantized(ck: Check, row: Row) -> None:
    """Weight-only int8 and int4 (Qwix) against the bf16 model: decode tokens/s at batch 1
    and 8 as ratios, and the weight bytes. The smoke quantizes and counts bytes only."""
    try:
        import qwix  # noqa: F401, PLC0415 - the optional extra `quant`
    except ImportError:
        row.status = "not landed"
        row.add("qwix (the extra `quant`) is not installed")
        return
    from logitloop.models import quantization  # noqa: PLC0415

    s = ck.shapes
    base = ck.model()
    formats = ("int4",) if ck.smoke else ("int8", "int4")
    group = 32 if ck.smoke else quantization.GROUP_SIZES[0]
    batches = s.decode_batches[:2]
    row.setup = (
        f"{s.model} bf16 vs {'/'.join(formats)} weights (int4 groups of {group}), "
        f"prompt {s.prompt}, B={'/'.join(map(str, batches))}"
    )
    models = {"bf16": base}
    for fmt in formats:
        ck.check_time()
        model = nnx.clone(base)
        quantization.quantize_model(model, quantization.check_quantize(fmt, group))
        models[fmt] = model
    size = {name: quantization.parameter_bytes(m) for name, m in models.items()}
    row.add(
        "weights " + ", ".join(f"{n} {gib(b)} ({b / size['bf16']:.2f}x)" for n, b in size.items())
    )
    # what the device holds: an int4 value in half a byte where it packs them (XLA:CPU: a byte)
    held = {name: quantization.device_bytes(m) for name, m in models.items()}
    row.add(
        "device buffers "
        + ", ".join(f"{n} {gib(b)} ({b / held['bf16']:.2f}x)" for n, b in held.items())
    )
    vocab = model_info(base).vocab_size
    rng = np.random.default_rng(0)
    if ck.smoke:
        # Quantizing and the bytes only: a quantized decode's compile would add ~10 s of
        # CPU to the default suite, where tests/models/test_quantized_decoding.py decodes.
        row.add("smoke: no decode")
        return
    for batch in batches:
        prompts = rng.integers(1, vocab, (batch, s.prompt)).tolist()
        rates = {}
        for name, model in models.items():
            ck.check_time()
            step, _, failure = decode_step(ck, model, prompts)
            if failure:
                row.fail(f"{name} B={batch}: {failure}")
            rates[name] = batch / step if step > 0 else float("nan")
        row.add(
            f"B={batch}: "
            + ", ".join(f"{n} {r:.0f} tok/s ({r / rates['bf16']:.2f}x)" for n, r in rates.items())
        )


def kv_bytes_per_slot(info) -> float:
    """Bytes of the cache per row and slot (keys and values of every layer)."""
    slots = 64
    shapes = jax.eval_shape(lambda: info.runner.init_cache(info.weights, 1, slots))
    return nbytes(shapes) / slots


def prefill(ck: Check, row: Row) -> None:
    s = ck.shapes
    info = model_info(ck.model())
    tokens = s.prefill
    row.setup = f"{s.model} bf16, one {tokens}-token prompt, one pass (loop.forward_prompt)"
    prompt = jnp.asarray(np.random.default_rng(1).integers(1, info.vocab_size, (1, tokens)))
    positions = jnp.arange(tokens, dtype=jnp.int32)[None]

    def pass_(weights, prompt, positions):
        logits, _ = forward_prompt(info.runner, weights, prompt, positions, tokens + 16)
        return logits

    t0 = time.perf_counter()
    compiled = jax.jit(pass_).lower(info.weights, prompt, positions).compile()
    row.add(f"compile {time.perf_counter() - t0:.1f} s")
    mem = compiled.memory_analysis()
    need = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    temp, arguments = mem.temp_size_in_bytes, mem.argument_size_in_bytes
    row.add(f"XLA: temporaries {gib(temp)}, arguments {gib(arguments)}")
    cost = compiled.cost_analysis() or {}
    flops = (cost[0] if isinstance(cost, list) else cost).get("flops")
    limit = ck.memory().get("bytes_limit")
    if limit is not None and need > limit:
        row.add(f"not run: needs {gib(need)} > {gib(limit)} on the device")
        row.status = "n/a"
        return
    ck.check_time()
    first = first_call(lambda: compiled(info.weights, prompt, positions))
    seconds = median_time(lambda: compiled(info.weights, prompt, positions), 1)
    logits = compiled(info.weights, prompt, positions)
    row.add(f"{seconds:.2f} s ({tokens / seconds:.0f} tok/s; first run {first:.2f} s)")
    if flops:
        row.add(f"{flops / seconds / 1e12:.3g} TFLOP/s of XLA's {flops / 1e12:.3g} TFLOP")
    peak = ck.memory().get("peak_bytes_in_use")
    row.add(f"device peak {gib(peak)} (process so far)" if peak else "device peak: not reported")
    if not np.isfinite(np.asarray(logits, np.float32)).all():
        row.fail("logits not finite")


def deterministic_kernel(ck: Check, model) -> str | None:
    """The tile kernel `deterministic=` runs `model`'s products with here (None: XLA's dots)."""
    return model_info(model, deterministic=ck.deterministic).runner.numerics.tile_kernel


def deterministic(ck: Check, row: Row) -> None:
    from bench_generate import mode_rates  # noqa: PLC0415 - a sibling script

    s = ck.shapes
    model = ck.model()
    det = ck.deterministic
    kernel = deterministic_kernel(ck, model)
    tokens = s.new_tokens // 2 + 1  # decode's short run: the default's program is compiled
    row.setup = f"{s.model} bf16, greedy, {tokens} tokens, products: {kernel or 'XLA dots'}"
    rng = np.random.default_rng(2)
    widest = max(s.deterministic_batches)
    prompts = rng.integers(1, model.config.vocab_size, (widest, s.prompt)).tolist()
    at = widest // 2  # the row watched: alone it is row 0, among others row `at`
    for batch in s.deterministic_batches:
        ck.check_time()
        rows = [prompts[at]] if batch == 1 else prompts[:batch]
        rate, compile_s, same = mode_rates(
            model, rows, tokens, s.repeats if ck.smoke else 3, (False, det)
        )
        row.add(
            f"B={batch}: {rate[det]:.0f} vs {rate[False]:.0f} tok/s "
            f"({rate[det] / rate[False]:.2f}x; compile+first {compile_s[det]:.0f} s; "
            f"tokens {'=' if same else '!='} default's)"
        )
    ck.check_time()

    def run(rows, det):
        params = ll.SamplingParams.create(batch_size=len(rows), temperature=0.0, max_tokens=tokens)
        return ll.generate(model, rows, params, ignore_eos=True, deterministic=det)

    for mode in (det, False):
        alone, among = run([prompts[at]], mode), run(prompts, mode)
        same = (
            alone.token_ids[0] == among.token_ids[at]
            and alone.raw_logprobs[0] == among.raw_logprobs[at]
        )
        name = "deterministic" if mode else "default"
        verdict = "bit for bit" if same else "differ"
        row.add(f"{name}: row alone vs row {at} of {widest}: {verdict}")
        if mode and not same:
            row.fail("deterministic=True row changed with the batch")


def speculative(ck: Check, row: Row) -> None:
    import bench_speculative as bs  # noqa: PLC0415 - a sibling script

    s = ck.shapes
    model = ck.model()
    prompt = bs.repeating_prompt(model.config.vocab_size)
    tokens = s.new_tokens  # plain at batch 1 is decode's program
    lookup = bs.variants(None, min_acceptance=0.0, cycle_cost=1.0)["ngram strict"]
    row.setup = (
        f"{s.model} bf16, B=1, {tokens} tokens, PromptLookup(3, 4) never off; "
        f"copy task: shipped model, {s.shipped_tokens} tokens"
    )
    repeats = s.repeats if ck.smoke else 3
    for temp in (0.0, 1.0):
        ck.check_time()
        times = measure_variants(
            model, prompt, temp, {"plain": None, "lookup": lookup}, tokens, repeats
        )
        (plain, _), (spec, (made, cycles, loop)) = times["plain"], times["lookup"]
        cost = bs.cycle_cost(spec, plain, tokens, loop)
        row.add(
            f"T={temp:g}: cycle = {cost:.2f} plain steps; plain {tokens / plain:.0f}, "
            f"lookup {made / spec:.0f} tok/s ({(made - 1) / max(cycles, 1):.2f} tokens/cycle)"
        )
    if ck.smoke:
        row.add("copy task: full runs only (its two programs would double the smoke's cost)")
        return
    shipped, copy_prompt = bs.load("shipped", "doc")
    for temp in (0.0, 1.0):
        ck.check_time()
        specs = {name: bs.variants(None)[name] for name in ("plain", "ngram strict")}
        times = measure_variants(shipped, copy_prompt, temp, specs, s.shipped_tokens, repeats)
        (plain, (made_p, _, _)), (spec, (made, cycles, _)) = times.values()
        row.add(
            f"copy T={temp:g}: plain {made_p / plain:.0f}, lookup {made / spec:.0f} tok/s "
            f"({plain / spec:.2f}x; {(made - 1) / max(cycles, 1):.2f} tokens/cycle)"
        )


def measure_variants(model, prompt, temp, specs, tokens, repeats) -> dict:
    """Per variant (name -> speculation or None): the median wall seconds of `repeats`
    batch-1 runs after a compiling one (variants alternating, run by run), and (tokens
    made, cycles, loop) of the last run (`bench_speculative.run`)."""
    import bench_speculative as bs  # noqa: PLC0415 - a sibling script

    for spec in specs.values():
        bs.run(model, prompt, 1, temp, spec, tokens)
    seconds, counts = {name: [] for name in specs}, {}
    for _ in range(repeats):
        for name, spec in specs.items():
            (wall, _), made, cycles, _, loop = bs.run(model, prompt, 1, temp, spec, tokens)
            seconds[name].append(wall)
            counts[name] = (made, cycles, loop)
    return {name: (statistics.median(seconds[name]), counts[name]) for name in specs}


def paged(ck: Check, row: Row) -> None:
    try:
        from logitloop.ops.attention import paged as paged_ops  # noqa: PLC0415
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("logitloop.ops.attention"):
            raise
        row.status = "not landed"
        row.add("logitloop/ops/attention/paged.py does not exist in this checkout")
        return
    paged_kernel(ck, row, paged_ops)
    if "kv_cache_tokens" not in inspect.signature(ll.generate_many).parameters:
        row.add("generate_many(kv_cache_tokens=): not landed")


def paged_kernel(ck: Check, row: Row, paged_ops) -> None:
    """One decode step's attention over a paged cache (the layout of `paged.py`: q [B, H,
    D], pages [Hkv, pages, page_size, D], tables [B, pages per row], lengths [B]), pages
    in random order, lengths uniform in 1 .. pages per row * page_size: the Pallas kernel
    (a GPU's; interpreted on a CPU; not on a TPU) and the XLA path (`backend="xla"`)
    against the gather reference, timed, and the floor: the live keys and values once."""
    p = ck.shapes.paged
    b, h, hkv, d = p["batch"], p["heads"], p["kv_heads"], p["head_dim"]
    page, per_row = p["page_size"], p["pages_per_row"]
    pages = b * per_row
    row.setup = f"B={b}, H={h}/{hkv}, D={d}, page {page}, {per_row} pages per row, bf16"
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
    k_pages, v_pages = (
        jnp.asarray(rng.standard_normal((hkv, pages, page, d)), jnp.bfloat16) for _ in range(2)
    )
    tables = jnp.asarray(rng.permutation(pages).reshape(b, per_row), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, per_row * page + 1, b), jnp.int32)
    args = (q, k_pages, v_pages, tables, lengths)
    want = paged_ops.paged_attention_reference(*args, scale=d**-0.5)
    runs = {"reference": lambda: paged_ops.paged_attention_reference(*args, scale=d**-0.5)}
    runs["xla"] = jax.jit(lambda *a: paged_ops.paged_attention(*a, backend="xla"))
    if ck.backend in ("gpu", "cpu"):
        runs["kernel"] = jax.jit(
            lambda *a: paged_ops.paged_attention(*a, backend="pallas", interpret=ck.interpret)
        )
    bw, _ = ck.floor_bandwidth()
    floor = int(jnp.sum(lengths)) * hkv * d * 2 * 2 / bw  # keys and values, bfloat16
    times = []
    for name, run in runs.items():
        ck.check_time()
        got = run() if name == "reference" else run(*args)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        call = run if name == "reference" else (lambda run=run: run(*args))
        seconds = median_time(call, ck.shapes.repeats, warmup=1)
        times.append(f"{name} {seconds * 1e6:.0f} us ({seconds / floor:.1f}x floor)")
        if name != "reference" and not err <= 2e-2:
            row.fail(f"{name} differs from the reference by {err:.1e} (> 2e-2, bfloat16)")
    row.add(", ".join(times) + f"; floor {floor * 1e6:.1f} us")
    if row.status == "ok":
        row.add(f"{' and '.join(n for n in runs if n != 'reference')} = reference within 2e-2")
    if "kernel" not in runs:
        row.add("kernel: n/a on TPU (a Triton kernel)")


RUN = dict(
    environment=environment,
    sampling=sampling,
    decode=decode,
    prefill=prefill,
    deterministic=deterministic,
    speculative=speculative,
    paged=paged,
    quantized=quantized,
)

# ----------------------------------------------------------------------------- driver


def run_section(ck: Check, number: int, name: str, budget_s: float) -> Row:
    """One section under its budget: a deadline the section checks between measurements
    (one compile and a few timed runs each), so it overruns by one measurement at most."""
    row = Row(number, name)
    t0 = time.monotonic()
    ck.deadline = t0 + budget_s
    try:
        RUN[name](ck, row)
    except OutOfTime:
        row.status = "out of time"
        row.add(f"budget of {budget_s:.0f} s ran out")
    except Exception as e:  # noqa: BLE001 - a section's failure is a row; the rest go on
        traceback.print_exc()
        row.status = "error"
        row.add(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    finally:
        ck.deadline = float("inf")
    row.seconds = time.monotonic() - t0
    return row


def watchdog(out: Path, seconds: float, current: list[str]) -> None:
    """A thread: if the run is still going `seconds` from now (a measurement that hangs),
    append a row saying so for the section `current[0]` and end the process (status 3),
    so that a device window's time limit never finds the table without its last row. Not
    an exception in the main thread: raised inside a running XLA call or a Pallas
    interpret callback, one can crash the process."""

    def stop():
        row = Row(SECTIONS.index(current[0]) + 1, current[0], status="out of time")
        row.add(f"hard stop: the run passed its budget and grace ({seconds:.0f} s)")
        line = row.markdown()
        print(line, flush=True)
        with out.open("a") as f:
            f.write(line + "\n")
        os._exit(3)

    timer = threading.Timer(seconds, stop)
    timer.daemon = True
    timer.start()


def parse_sections(names: list[str]) -> list[str]:
    """Section names or numbers (1-based), in the table's order."""
    chosen = set()
    for name in names:
        for part in name.split(","):
            if part.isdigit() and 1 <= int(part) <= len(SECTIONS):
                chosen.add(SECTIONS[int(part) - 1])
            elif part in SECTIONS:
                chosen.add(part)
            elif part:
                raise SystemExit(
                    f"--sections: {part!r} is not one of 1-{len(SECTIONS)} or "
                    + ", ".join(SECTIONS)
                )
    return [s for s in SECTIONS if s in chosen]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("device_check.md"), help="Markdown table")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), help="names or 1-7")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds for all sections")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; kernels interpreted")
    args = ap.parse_args(argv)
    sections = parse_sections(args.sections)
    if args.smoke:
        # Before the backend starts: the smoke's numbers mean nothing, so its programs
        # compile without LLVM's optimisations (half the CPU time of a run).
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} {SMOKE_XLA_FLAGS}".strip()
    shapes = SMOKE if args.smoke else FULL
    if not args.smoke and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        # A rerun in the same window (after a fix, or a run cut short) reads its programs
        # back instead of compiling them again.
        jax.config.update("jax_compilation_cache_dir", str(COMPILE_CACHE))
    budget = args.budget_s or (80.0 if args.smoke else float(sum(ESTIMATE_S.values())))

    ck = Check(shapes, args.smoke)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (
        f"Device check, {stamp}: {ck.device.device_kind} ({ck.backend}), "
        f"{'smoke' if args.smoke else 'full'} shapes, budget {budget:.0f} s, "
        f"`python scripts/device_check.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
        f"\n\n{TABLE_HEAD}\n"
    )
    args.out.write_text(head)
    print(head, end="", flush=True)
    end = time.monotonic() + budget
    current = [sections[0]]
    watchdog(args.out, budget + max(60.0, budget / 4), current)
    status = 0
    for i, name in enumerate(sections):
        current[0] = name
        rest = sum(ESTIMATE_S[s] for s in sections[i:])
        share = max(end - time.monotonic(), 0.0) * ESTIMATE_S[name] / rest
        row = run_section(ck, SECTIONS.index(name) + 1, name, max(share, 1.0))
        line = row.markdown()
        print(line, flush=True)
        with args.out.open("a") as f:
            f.write(line + "\n")
        if row.status in ("FAILED", "error"):
            status = 1
        if name == "environment" and not args.smoke and ck.backend == "cpu":
            return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
