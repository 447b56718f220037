"""`python -m logitloop.cli ...`: the same command line as `python -m logitloop`."""

from logitloop.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
