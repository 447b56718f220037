"""The scripted fake model of `tests/decoding/scripted.py`, loaded from its file.

`tests/` is not a package, so a relative import cannot reach a sibling test folder.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_NAME = "decoding.scripted"  # the name pytest gives it when tests/decoding runs too
if _NAME in sys.modules:
    _module = sys.modules[_NAME]
else:
    _spec = importlib.util.spec_from_file_location(
        _NAME, Path(__file__).resolve().parents[1] / "decoding" / "scripted.py"
    )
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)

expected = _module.expected
make_model = _module.make_model
