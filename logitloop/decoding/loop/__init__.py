"""The device loop: the model's static runner (`runner`), where arrays live (`layout`, and
`sharding` on a mesh), stop strings matched on device (`stop_strings`), the loop state,
prefill and the decode `while_loop` (`decode_loop`), and speculative decoding's loop body
(`speculative`).

May import: `logitloop.decoding.runtime`, `logitloop.decoding.sampling`, `logitloop.ops`,
`logitloop.models`; nothing from `engine`.
"""
