"""Plans kept on disk: a step planned once is not planned again by the next run of the same step, and a question
`autosp plan` answered once is answered again from disk.

Planning is most of a warm start (bench/RESULTS.md, "plans kept on disk": `autosp train --model tiny --sp 2
--seq-len 4096 --memory 24MiB` spent 20 s of its first rank's 30 s before the first step in the planner). A run that
is started again (a resume, the next experiment at the same length, `autosp plan`'s printed command) reads the plan
back instead. Entries come in two layers, one folder, one format:

    plan      what the planning rank broadcasts (compile_step): the Plan, the values saved, recomputed and
              offloaded, and the tiling; at a hit the joint program is differentiated again, the plan applied to
              it and the result simulated again (remat/__init__.py, _planned: the Plan's peak_bytes is the
              simulation's, not the stored one). A refused budget is kept too (its message and least peak).
    answer    `autosp plan`'s whole answer to one command line (run/answer.py, answer): the text it printed and
              whether it fits. A hit traces and differentiates nothing; the plans under it stay kept for train.

A plan's key is everything a plan is a function of:

    the per-rank program as printed   every equation, shape, dtype, layout and name the plan refers to
    the budget, the device's model    the budget as given, the cost model (device_for: link, FLOP/s), the host
                                      capacity, the tiling asked for, whether the plan is refined
    what the memory model reads       torch's thread count (CPU attention's scratch is per thread), whether
                                      collectives are scheduled (AUTOSP_OVERLAP: the simulated programs)
    what made it                      autosp's sources, torch's version (the joint is derived again at a hit),
                                      scipy's (HiGHS), Python's (pickle)

An answer's key is the question as normalised (the Step, the granularity), what the answer reads besides (the model
config's bytes, transformers' version, the device's model, the thread count, the AUTOSP_ environment) and what made
it, as above (answer_key).

An entry is a pickle, and unpickling runs code, so only what this user alone could have written is read: the
folder and the entry must belong to this process's uid and be writable by no group or other user. Otherwise the
entry is ignored (planned afresh, nothing written there), and the process says so once, with the path and the fix.
autosp makes the folder (and each parent it makes) 0o700, an entry 0o600, and writes it atomically (a temporary
file renamed over it); an entry that is a symbolic link is not followed.

A plan or an answer is kept only when every MIP of its making finished (forked helpers' included): one cut short by
its time limit (solve.TIME_LIMIT) answers with HiGHS's best so far, which another run on a busier machine may not
reach, and ranks that plan apart (the sp groups of a dp x sp mesh) must reach one plan. Unreadable entries are
planned again and overwritten. Nothing is evicted (an entry is 7-21 KiB for the tiny preset): removing the folder
clears it.

    AUTOSP_PLAN_CACHE   a folder (default $XDG_CACHE_HOME/autosp/plans, else ~/.cache/autosp/plans); 0 or off: none
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import tempfile
import warnings

VERSION = 1                 # the entry's layout
_WARNED = False             # an ignored cache is said once a process (every entry of a shared folder would repeat it)


def folder() -> pathlib.Path | None:
    """Where plans are kept, or None when AUTOSP_PLAN_CACHE turns keeping off."""
    where = os.environ.get("AUTOSP_PLAN_CACHE", "")
    if where.lower() in ("0", "off", "false", "no"):
        return None
    if where:
        return pathlib.Path(where).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "autosp" / "plans"


def key(local, memory_budget, dev, *, host_memory=None, refine: bool = True, tiles=None, attention=None,
        enough=None) -> str:
    """A plan entry's name: a digest of what the plan of `local` under these arguments is a function of."""
    import torch

    from autosp.passes.schedule import enabled
    return _digest(f"threads {torch.get_num_threads()}", f"overlap {enabled()}", repr(memory_budget), repr(dev),
                   repr(host_memory), repr(refine), repr(None if tiles is None else sorted(tiles.items())),
                   repr(attention), *(() if enough is None else (f"enough {enough}",)), str(local))


def answer_key(question: str, *inputs: str) -> str:
    """An answer entry's name: a digest of the question as normalised (`question`), what else the answer reads
    (`inputs`) and what made it (the same as key's)."""
    return _digest("answer", question, *inputs)


def _digest(*parts: str) -> str:
    """sha256 over `parts` and what made the entry: its layout, autosp's sources, torch's, scipy's and Python's
    versions."""
    import scipy
    import torch

    from autosp.sources import digest
    h = hashlib.sha256()
    for part in (f"v{VERSION}", digest(), torch.__version__, scipy.__version__, f"{sys.version_info[:2]}", *parts):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def path(name: str) -> pathlib.Path | None:
    """Where the entry `name` is kept (None: keeping is off)."""
    where = folder()
    return None if where is None else where / f"{name}.plan"


def load(name: str):
    """The entry kept under `name` (its path set on its Plan), or None: none kept, keeping off, unreadable, or not
    this user's alone (said once: see the module's docstring)."""
    from dataclasses import replace

    from autosp.ir.serial import loads
    where = folder()
    if where is None or not _private(where):
        return None
    path = where / f"{name}.plan"
    try:
        # O_NOFOLLOW: a link planted in the folder is not read through; the checks are on what was opened (fstat)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not _trusted(path, os.fstat(f.fileno())):
            return None
        data = f.read()
    try:
        entry = loads(data)
    except Exception:  # noqa: BLE001 - a torn or stale entry: planned again, and overwritten
        return None
    if not isinstance(entry, tuple) or not entry or entry[0] not in ("plan", "refused", "answer"):
        return None
    if entry[0] == "plan":
        entry = (entry[0], replace(entry[1], stored=str(path)), *entry[2:])
    return entry


def save(name: str, entry: tuple) -> None:
    """Keep `entry` under `name`, atomically (ranks of several sp groups may write one entry at once), readable by
    this user alone; a folder that cannot be written keeps nothing, silently (keeping is an optimisation), and one
    that is not this user's alone keeps nothing either (said once)."""
    from autosp.ir.serial import dumps
    where = folder()
    if where is None:
        return
    try:
        _make_private(where)
        if not _private(where):
            return
        fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{name[:16]}-", suffix=".tmp")     # 0o600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(dumps(entry))
            os.replace(tmp, where / f"{name}.plan")
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return


def _make_private(where: pathlib.Path) -> None:
    """Make `where` and each missing parent, 0o700 (mkdir's mode is masked by the umask, and parents=True gives
    the parents the umask's mode alone). A folder another process made first is left as it is: _private judges it."""
    missing = []
    while not where.is_dir():
        missing.append(where)
        if where.parent == where:
            break
        where = where.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(path, 0o700)


def _uid() -> int | None:
    """The uid an entry and its folder must belong to: this process's; None where the OS has no uids (Windows,
    where POSIX modes are not what guards a file either: nothing is checked)."""
    return os.getuid() if hasattr(os, "getuid") else None


def _private(where: pathlib.Path) -> bool:
    """Whether entries in the folder `where` may be read or written: it is there, and this user's alone."""
    try:
        st = os.stat(where)
    except OSError:
        return False
    return _trusted(where, st)


def _trusted(path, st) -> bool:
    """Whether the file or folder `path`, of stat `st`, is this user's alone; if not, said once a process."""
    uid = _uid()
    if uid is None:
        return True
    if st.st_uid != uid:
        _warn(path, f"it belongs to uid {st.st_uid}, not to this process's uid {uid}, and reading it would run "
                    f"what its owner wrote",
              f"AUTOSP_PLAN_CACHE=<a folder of your own>, or remove {path} if it is not meant to be there")
        return False
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("its group", 0o020), ("other users", 0o002)) if st.st_mode & bit)
        _warn(path, f"it is writable by {who} (mode {st.st_mode & 0o7777:o}), who could plant code in it",
              f"chmod go-w {path}, or AUTOSP_PLAN_CACHE=<a folder of your own>")
        return False
    return True


def _warn(path, why: str, fix: str) -> None:
    global _WARNED
    if _WARNED:
        return
    _WARNED = True
    warnings.warn(f"autosp's plan cache: {path} is ignored, the step planned afresh: {why}. Fix: {fix}.",
                  stacklevel=2)
