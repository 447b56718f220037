"""`logitloop explain`'s presentation of an `Explanation` (`logitloop.decoding.engine.explain`):
the terminal table and the matplotlib figure.

    expl = explain_next_token(model, "Once upon a time", params)   # params: batch of 1
    print(format_table(expl, top=10))
    fig = explanation_figure(expl, draw_next_tokens(expl, 2000))   # needs matplotlib
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from logitloop.decoding.engine.explain import (
    KEPT,
    STAGES,
    STEP_NAMES,
    Explanation,
    temperature_sweep,
)
from logitloop.decoding.sampling.sampler import STATUS_ALL_MASKED, STATUS_BAD_LOGITS, STATUS_OK

STATUS_NAMES = {
    STATUS_OK: "ok",
    STATUS_ALL_MASKED: "every token is masked",
    STATUS_BAD_LOGITS: "the logits hold NaN or +inf",
}


def _fmt_prob(p: float) -> str:
    if p == 0:
        return "0"
    if p >= 1e-3:
        return f"{p:.4f}"
    return f"{p:.1e}"


def _fmt_threshold(v: float) -> str:
    return "off" if v == -np.inf else f"{v:.4g}"


def describe_knobs(expl: Explanation) -> str:
    """One line with the row's scalar knobs and lists that are set."""
    p = expl.params
    parts = [
        f"temperature={expl.knob('temperature'):g}",
        f"top_k={expl.knob('top_k')}",
        f"top_p={expl.knob('top_p'):g}",
        f"min_p={expl.knob('min_p'):g}",
        f"repetition_penalty={expl.knob('repetition_penalty'):g}",
        f"presence_penalty={expl.knob('presence_penalty'):g}",
        f"frequency_penalty={expl.knob('frequency_penalty'):g}",
        f"seed={expl.seed}",
    ]
    ids = np.asarray(p.bias_ids)[0]
    vals = np.asarray(p.bias_values)[0]
    bias = {int(t): float(v) for t, v in zip(ids, vals, strict=True) if t >= 0}
    if bias:
        parts.append("logit_bias={" + ", ".join(f"{t}: {v:g}" for t, v in bias.items()) + "}")
    banned = [int(t) for t in np.asarray(p.banned_ids)[0] if t >= 0]
    if banned:
        parts.append(f"banned={banned}")
    if bool(np.asarray(p.has_allowed)[0]):
        parts.append(f"allowed={[int(t) for t in np.asarray(p.allowed_ids)[0] if t >= 0]}")
    min_tokens = expl.knob("min_tokens")
    if min_tokens:
        stops = [int(t) for t in np.asarray(p.stop_token_ids)[0] if t >= 0]
        parts.append(f"min_tokens={min_tokens} (suppresses stop ids {stops})")
    return " ".join(parts)


def format_table(expl: Explanation, top: int = 10) -> str:
    """The terminal table: per candidate, its probability after every step and its fate."""
    ids = expl.candidates(top)
    width = max([len("token")] + [min(len(expl.token_text(t)), 24) for t in ids])
    stage_titles = [title for _, title in STAGES]
    col = [max(9, len(t)) for t in stage_titles]
    head = f"{'#':>3}  {'id':>6}  {'token':<{width}}  " + "  ".join(
        f"{t:>{w}}" for t, w in zip(stage_titles, col, strict=True)
    )
    lines = [
        f"prompt: {len(expl.prompt_token_ids)} tokens; next token (generated index 0)",
        f"knobs: {describe_knobs(expl)}",
        "thresholds on the scaled logits: "
        f"top-k {_fmt_threshold(expl.thresholds['top_k'])}, "
        f"top-p {_fmt_threshold(expl.thresholds['top_p'])}, "
        f"min-p {_fmt_threshold(expl.thresholds['min_p'])}; "
        + (
            f"kept: scaled >= {expl.thresholds['kept']:.4g}"
            if expl.thresholds["kept"] > -np.inf
            else "kept: every token not masked"
        )
        + (" (greedy: only the argmax)" if expl.greedy else ""),
        "probability after each step, renormalised over the tokens it keeps:",
        "",
        head + "  kept/cut",
        "-" * (len(head) + 10),
    ]
    stages = expl.stages()
    for rank, t in enumerate(ids, 1):
        text = expl.token_text(t)
        if len(text) > 24:
            text = text[:23] + "…"
        probs = "  ".join(
            f"{_fmt_prob(float(arr[t])):>{w}}" for (_, arr), w in zip(stages, col, strict=True)
        )
        fate = "kept" if expl.cut[t] == KEPT else f"cut: {STEP_NAMES[int(expl.cut[t])]}"
        lines.append(f"{rank:>3}  {int(t):>6}  {text:<{width}}  {probs}  {fate}")
    rest = np.ones(expl.vocab_size, bool)
    rest[ids] = False
    if rest.any():
        probs = "  ".join(
            f"{_fmt_prob(float(arr[rest].sum())):>{w}}"
            for (_, arr), w in zip(stages, col, strict=True)
        )
        kept_rest = int(np.sum(expl.cut[rest] == KEPT))
        label = f"other {int(rest.sum())}"
        lines.append(f"{'':>3}  {'':>6}  {label:<{width}}  {probs}  {kept_rest} kept")
    n_kept = int(np.sum(expl.cut == KEPT))
    lines.append("")
    if expl.repetition_cut is not None:
        n, p = expl.repetition_cut
        lines.append(
            f"repetition guard: a row that generated the prompt and the sampled token would "
            f"have been cut after token {n} of {len(expl.prompt_token_ids) + 1} (a period of "
            f"{p} token{'s' if p > 1 else ''}, finish_reason 'repetition')"
        )
    if expl.status != STATUS_OK:
        lines.append(
            f"status: {STATUS_NAMES.get(expl.status, expl.status)}: ll.sample returns token 0 "
            "with log-probability -inf and generate ends the row with finish_reason 'error'"
        )
    else:
        lines.append(
            f"{n_kept} of {expl.vocab_size} tokens kept; with seed {expl.seed}, ll.sample draws "
            f"{expl.token_text(expl.sampled_token)} (id {expl.sampled_token}, final probability "
            f"{_fmt_prob(float(np.exp(expl.sampled_logprob)))})"
        )
    return "\n".join(lines)


def explanation_figure(
    expl: Explanation,
    draws: np.ndarray | None = None,
    *,
    top: int = 10,
    temperatures: Sequence[float] | None = None,
):
    """A matplotlib Figure with three panels (Agg canvas; needs matplotlib):

    1. the probability of the top candidates against temperature (solid: temperature
       alone; dashed: after every knob), the row's own temperature marked;
    2. raw vs final probabilities of the candidates, the cut ones marked with their step;
    3. tokens drawn by `ll.sample` (`draws`, e.g. from `draw_next_tokens`) as a histogram
       against the final distribution.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ids = expl.candidates(top)
    labels = [expl.token_text(t) for t in ids]
    labels = [s if len(s) <= 14 else s[:13] + "…" for s in labels]
    t_row = expl.knob("temperature")
    if temperatures is None:
        temperatures = np.linspace(0.1, max(2.0, 1.25 * t_row), 60)
    sweep = temperature_sweep(expl, temperatures)

    fig = Figure(figsize=(19, 5.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_t, ax_c, ax_d = fig.subplots(1, 3)
    colors = [f"C{i % 10}" for i in range(len(ids))]

    # 1. temperature
    filtered = expl.knob("top_k") > 0 or expl.knob("top_p") < 1.0 or expl.knob("min_p") > 0
    for k, t in enumerate(ids[: min(len(ids), 8)]):
        ax_t.plot(sweep["temperature"], sweep["tempered"][:, t], color=colors[k], label=labels[k])
        if filtered:
            ax_t.plot(sweep["temperature"], sweep["final"][:, t], color=colors[k], ls="--", lw=1)
    ax_t.axvline(t_row, color="k", ls=":", lw=1)
    ax_t.annotate(
        f"T = {t_row:g}" + (" (greedy)" if t_row == 0 else ""),
        (t_row, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(3, -12),
        textcoords="offset points",
    )
    ax_t.set_xlabel("temperature")
    ax_t.set_ylabel("probability")
    ax_t.set_title(
        "temperature" + (" (solid: alone; dashed: with top-k/top-p/min-p)" if filtered else "")
    )
    ax_t.legend(fontsize="small", loc="upper right")
    ax_t.set_ylim(0, 1.02)

    # 2. raw vs final, on a log scale so that the model's own small probabilities show
    x = np.arange(len(ids))
    shown = np.concatenate([expl.raw[ids], expl.final[ids]])
    positive = shown[shown > 0]
    floor = float(positive.min()) / 4 if positive.size else 1e-6
    ax_c.set_yscale("log")
    ax_c.bar(x - 0.2, expl.raw[ids], width=0.4, color="0.65", label="raw (model)")
    ax_c.bar(x + 0.2, expl.final[ids], width=0.4, color="tab:purple", label="final")
    cut_marked = False
    for i, t in enumerate(ids):
        if expl.cut[t] != KEPT:
            ax_c.plot(
                x[i] + 0.2,
                floor * 1.6,
                "x",
                color="tab:red",
                ms=8,
                label=None if cut_marked else "cut (by the step named)",
            )
            cut_marked = True
            ax_c.annotate(
                STEP_NAMES[int(expl.cut[t])],
                (x[i] + 0.2, floor * 2.2),
                ha="center",
                va="bottom",
                fontsize="x-small",
                rotation=90,
                color="tab:red",
            )
    ax_c.set_xticks(x, labels, rotation=60, ha="right", fontsize="small")
    ax_c.set_ylabel("probability (log scale)")
    ax_c.set_ylim(floor, 1.5)
    ax_c.set_title("raw vs final (after every knob)")
    ax_c.legend(fontsize="small", loc="upper right")

    # 3. draws
    if expl.status != STATUS_OK:
        ax_d.set_title(f"no draws: {STATUS_NAMES.get(expl.status, expl.status)}")
    elif draws is not None and len(draws):
        draws = np.asarray(draws)
        n = len(draws)
        pos = {int(t): i for i, t in enumerate(ids)}
        counts = np.zeros(len(ids) + 1)
        for t in draws:
            counts[pos.get(int(t), len(ids))] += 1
        expected = np.append(expl.final[ids], max(0.0, 1.0 - float(expl.final[ids].sum())))
        xd = np.arange(len(ids) + 1)
        ax_d.bar(xd, counts / n, width=0.7, color="tab:purple", alpha=0.6, label=f"{n} draws")
        sd = np.sqrt(expected * (1 - expected) / n)
        ax_d.errorbar(
            xd,
            expected,
            yerr=2 * sd,
            fmt="o",
            color="k",
            ms=4,
            capsize=3,
            label="final distribution ± 2σ",
        )
        ax_d.set_xticks(xd, [*labels, "other"], rotation=60, ha="right", fontsize="small")
        ax_d.legend(fontsize="small")
        ax_d.set_title(f"ll.sample, {n} seeds from {expl.seed}")
    else:
        ax_d.set_title("ll.sample draws (none)")
    ax_d.set_ylabel("frequency")

    fig.suptitle(f"next token: {describe_knobs(expl)}", fontsize="medium")
    return fig
