"""Byte counts as people read them: `fmt_bytes(3 * 2**20) == "3.00 MiB"`.

One formatter for every report (remat plans, explain's collectives, `autosp plan` and `train`), so that a size
reads the same wherever it is printed. It sits at the bottom of the package, importing nothing of autosp, so
that any layer may use it (passes/schedule.py and remat/plan.py alike) without an import running upwards.
"""
from __future__ import annotations

_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def fmt_bytes(n: float | None) -> str:
    """`n` bytes in the largest binary unit it reaches, two decimals; "none" for None (no budget, no limit)."""
    if n is None:
        return "none"
    for unit, size in _BINARY:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
