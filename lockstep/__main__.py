"""``python -m lockstep run ...``: the same command line as the ``lockstep`` program."""

from lockstep.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
