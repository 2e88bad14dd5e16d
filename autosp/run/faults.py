"""A fault hook for tests and drills: make one rank fail at a chosen point of a run.

    AUTOSP_FAULT=RANK:STEP:WHAT autosp train ...

WHAT is `raise` (an exception at the start of step STEP), `kill` (SIGKILL there), `hang` (sleep
there, for the collective timeout to catch), or `save-raise` / `save-kill` (the same in the middle
of writing checkpoint STEP: this rank's data written, the metadata and the rename not yet done).
Unset, the hook costs one dict lookup.
"""
from __future__ import annotations

import os
import signal
import time

_KINDS = {"raise", "kill", "hang", "save-raise", "save-kill"}


class InjectedFault(RuntimeError):
    """The failure AUTOSP_FAULT asked for."""


def parse(text: str | None):
    if not text:
        return None
    parts = text.split(":")
    if len(parts) != 3 or parts[2] not in _KINDS or not parts[0].isdigit() or not parts[1].isdigit():
        raise ValueError(f"AUTOSP_FAULT={text!r}: expected RANK:STEP:WHAT with WHAT one of {sorted(_KINDS)}")
    return int(parts[0]), int(parts[1]), parts[2]


def maybe_fail(where: str, step: int) -> None:
    """Fail here if AUTOSP_FAULT names this rank, this step and this place ('step' or 'save')."""
    spec = parse(os.environ.get("AUTOSP_FAULT"))
    if spec is None:
        return
    rank, at, what = spec
    place = "save" if what.startswith("save-") else "step"
    if rank != int(os.environ.get("RANK", "0")) or at != step or place != where:
        return
    what = what.removeprefix("save-")
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "hang":
        while True:
            time.sleep(60)
    raise InjectedFault(f"AUTOSP_FAULT: rank {rank} fails at {where} {step}, as asked")
