"""Plans kept on disk: a step planned once is not planned again by the next run of the same step.

Planning is most of a warm start. `autosp train --model tiny --sp 2 --seq-len 4096 --memory 24MiB` spent 20 s of
its first rank's 30 s before the first step in the planner (12 s of it in HiGHS), after the launcher's own 7.5 s
checking the fit; inductor's cache already made the compiled step's warm start 8 s. A run that is started again (a
resume, the next experiment at the same length, `autosp plan`'s printed command) plans the same step again.

An entry is what the planning rank broadcasts (compile_step): the Plan, the values saved, recomputed and offloaded,
and the tiling; at a hit the joint program is differentiated again and the plan applied to it (seconds, not the
solves). A refused budget is kept too (its message and least peak). The key is everything a plan is a function of:

    the per-rank program as printed   every equation, shape, dtype, layout and name the plan refers to
    the budget, the device's model    the budget as given, the cost model (device_for: link, FLOP/s), the host
                                      capacity, the tiling asked for, whether the plan is refined
    what the memory model reads       torch's thread count (CPU attention's scratch is per thread), whether
                                      collectives are scheduled (AUTOSP_OVERLAP: the simulated programs)
    what made it                      autosp's sources, torch's version (the joint is derived again at a hit),
                                      scipy's (HiGHS), Python's (pickle)

A plan is kept only when every MIP of its making finished: one cut short by its time limit (solve.TIME_LIMIT)
answers with HiGHS's best so far, which another run on a busier machine may not reach, and ranks that plan apart
(the sp groups of a dp x sp mesh) must reach one plan. Unreadable entries are planned again and overwritten.
Nothing is evicted (an entry is 7-21 KiB for the tiny preset): removing the folder clears it.

    AUTOSP_PLAN_CACHE   a folder (default $XDG_CACHE_HOME/autosp/plans, else ~/.cache/autosp/plans); 0 or off: none
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import tempfile

VERSION = 1                 # the entry's layout


def folder() -> pathlib.Path | None:
    """Where plans are kept, or None when AUTOSP_PLAN_CACHE turns keeping off."""
    where = os.environ.get("AUTOSP_PLAN_CACHE", "")
    if where.lower() in ("0", "off", "false", "no"):
        return None
    if where:
        return pathlib.Path(where).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "autosp" / "plans"


def key(local, memory_budget, dev, *, host_memory=None, refine: bool = True, tiles=None) -> str:
    """The entry's name: a digest of what the plan of `local` under these arguments is a function of."""
    import scipy
    import torch

    from autosp.passes.schedule import enabled
    from autosp.sources import digest
    h = hashlib.sha256()
    for part in (f"v{VERSION}", digest(), torch.__version__, scipy.__version__, f"{sys.version_info[:2]}",
                 f"threads {torch.get_num_threads()}", f"overlap {enabled()}",
                 repr(memory_budget), repr(dev), repr(host_memory), repr(refine),
                 repr(None if tiles is None else sorted(tiles.items())), str(local)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def load(name: str):
    """The entry kept under `name` (its path set on its Plan), or None: none kept, keeping off, or unreadable."""
    from dataclasses import replace

    from autosp.ir.serial import loads
    where = folder()
    if where is None:
        return None
    path = where / f"{name}.plan"
    try:
        entry = loads(path.read_bytes())
    except Exception:  # noqa: BLE001 - none kept, or a torn or stale entry: planned again, and overwritten
        return None
    if not isinstance(entry, tuple) or not entry or entry[0] not in ("plan", "refused"):
        return None
    if entry[0] == "plan":
        entry = (entry[0], replace(entry[1], stored=str(path)), *entry[2:])
    return entry


def save(name: str, entry: tuple) -> None:
    """Keep `entry` under `name`, atomically (ranks of several sp groups may write one entry at once); a folder
    that cannot be written keeps nothing, silently: keeping is an optimisation."""
    from autosp.ir.serial import dumps
    where = folder()
    if where is None:
        return
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{name[:16]}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(dumps(entry))
            os.replace(tmp, where / f"{name}.plan")
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return
