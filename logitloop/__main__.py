"""`python -m logitloop ...`: the same command line as the `logitloop` script."""

from logitloop.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
