"""Decoding, in four layers whose imports go one way (each subpackage's docstring says what
it holds): `runtime` (compile bookkeeping) <- `sampling` (one step per row) <- `loop` (the
device loop) <- `engine` (the host side and the entry points).
"""
