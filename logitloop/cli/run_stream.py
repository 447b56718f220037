"""`logitloop generate --stream`: the prompts' completions printed as they are generated.

The prompts go through `ll.stream` `--batch-size` at a time, `n` rows each. Rows finish in
any order, but the text comes out in `TextOutput`'s order and blocks (`==> ID #k <==`
headers when there is more than one completion): the first unfinished row's text is
printed live, the others' is held until every row before them is printed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from logitloop.cli.common import CLIError
from logitloop.jobs.items import Item, adapter_rows, span
from logitloop.jobs.sinks import TextOutput


def stream_items(
    model,
    items: Sequence[Item],
    sink: TextOutput,
    *,
    n: int,
    batch_size: int,
    ignore_eos: bool,
    deterministic: bool | str = False,
    speculative=None,
    adapters=None,
) -> int:
    """Stream every item's `n` completions to stdout; returns the tokens generated."""
    tokens = 0
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        try:
            tokens += _stream_batch(
                model, batch, sink, n=n, ignore_eos=ignore_eos, deterministic=deterministic,
                speculative=speculative, **adapter_rows(adapters, batch),
            )  # fmt: skip
        except ValueError as e:
            raise CLIError(f"{span(batch)}: {e}") from None
    return tokens


def _stream_batch(model, items, sink, *, n, **options) -> int:
    import logitloop as ll
    from logitloop.decoding.sampling.params import SamplingParams

    out = sys.stdout
    params = SamplingParams.concat([item.params for item in items])
    rows = len(items) * n
    held = [""] * rows  # text of rows after the one being printed
    finished = [False] * rows
    current = 0  # the row being printed live
    tokens = 0

    def begin(row: int) -> None:
        if sink.headers:
            item, k = items[row // n], row % n
            sample = f" #{k}" if n > 1 else ""
            sep = "\n" if sink.blocks else ""
            out.write(f"{sep}==> {item.id}{sample} <==\n")
        out.write(held[row])
        held[row] = ""

    def end() -> None:
        out.write("\n")
        sink.blocks += 1

    begin(0)
    events = ll.stream(model, [item.token_ids for item in items], params, n=n, **options)
    for event in events:
        tokens += len(event.token_ids)
        if event.row == current:
            out.write(event.text)
        else:
            held[event.row] += event.text
        finished[event.row] = event.finish_reason is not None
        while current < rows and finished[current]:
            end()
            current += 1
            if current < rows:
                begin(current)
        out.flush()
    return tokens
