"""Compile bookkeeping: counting and timing compilations (`compiles`). (The persistent
compile cache is `logitloop.compile_cache`: JAX's own, which the CLI and
`ll.enable_compile_cache` turn on.)

May import: nothing else from `logitloop.decoding` (every other layer builds on it).
"""
