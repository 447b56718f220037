"""Compile bookkeeping: the compiled-program store (`programs`) and compile counting
(`compiles`).

May import: nothing else from `logitloop.decoding` (every other layer builds on it).
"""
