"""Adapters to other tools, each behind an optional extra and imported only when used:
`lm_eval.py` (an lm-evaluation-harness backend, extra `eval`) and `ray.py` (batch jobs on
Ray Data, extra `ray`). Each is a thin layer over the public API (`score`, `generate_many`):
no second copy of batching, stops or scoring."""
