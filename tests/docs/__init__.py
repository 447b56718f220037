"""The documentation's tests: its code blocks (conftest.py collects the Python ones,
`test_shell_blocks.py` runs the shell ones) and the API reference's coverage."""

from pathlib import Path

ROOT = Path(__file__).parents[2]
# The Markdown files whose code blocks are tests: README.md and the guides in docs/ (not
# BENCHMARKS.md, whose commands are records of measurements).
DOC_FILES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
