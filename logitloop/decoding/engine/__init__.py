"""The host side: the plan every entry point starts from (`plan`), prompts in and results
out (`host`), and the entry points `generate`/`stream` (`generate`), `generate_many`
(`batching`) and `explain_next_token` (`explain`).

May import: every other layer of `logitloop.decoding`.
"""
