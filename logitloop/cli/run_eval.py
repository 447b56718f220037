"""`logitloop eval ARGS...`: lm-evaluation-harness's own command line with the `logitloop`
backend registered (lm-eval's CLI never imports outside code, so `lm_eval --model
logitloop` alone does not find it). ARGS are lm-eval's, unchanged:

    logitloop eval --model logitloop --model_args pretrained=PATH,dtype=float32 \\
        --tasks hellaswag --batch_size 8
"""

from __future__ import annotations

import sys

from logitloop.cli.common import CLIError


def run(argv: list[str]) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        raise CLIError(
            f"eval needs lm-evaluation-harness: pip install 'logitloop[eval]' ({e})"
        ) from e
    import logitloop  # noqa: F401  (registers the backend with lm-eval)

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # lm-eval's CLI reads sys.argv itself
    try:
        cli_evaluate()
    except ValueError as e:  # a bad model_args value, a request over the context
        raise CLIError(str(e)) from e
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0
