"""Adapters to other tools, each over the public API and each importing its tool lazily
behind an optional extra: `lm_eval.py` (an lm-evaluation-harness backend, extra `eval`)."""
