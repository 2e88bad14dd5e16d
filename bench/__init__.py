"""Benchmarks; figures and commands in bench/RESULTS.md."""


def command(script: str, argv=None) -> str:
    """The command line that ran a bench script, as RESULTS.md quotes it: `.venv/bin/python bench/x.py ...`."""
    import os
    import shlex
    import sys
    args = sys.argv[1:] if argv is None else argv
    return " ".join([".venv/bin/python", f"bench/{os.path.basename(script)}"] + [shlex.quote(a) for a in args])
