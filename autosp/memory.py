"""Per-rank peak memory of a step, as MemTracker sees it (every allocation, autograd's included)."""
from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker


def peak_bytes(step, *tracked: torch.Tensor) -> tuple[int, object]:
    """(peak bytes on the step's device, step's result); `tracked` tensors live before the step."""
    mt = MemTracker()
    if tracked:
        mt.track_external(*tracked)
    with mt:
        out = step()
    snap = mt.get_tracker_snapshot("peak")
    return max(v.get("Total", 0) for v in snap.values()), out
