"""Measured memory: the peak bytes a step allocates on top of what was live before it.

The profiler's allocation events (`profile_memory=True`) see every allocation through torch's
allocator, including those inside collectives, attention and autograd.grad; the running sum
of their sizes, in time order, peaks where the step does. (MemTracker misses op-internal
buffers and refuses torch.autograd.grad.) On CUDA the allocator's own peak counter is used.
"""
from __future__ import annotations

import torch


def peak_bytes(step, *tracked: torch.Tensor, device: str | None = None) -> tuple[int, object]:
    """(peak bytes allocated by step() above what was live when it began, step's result).

    `tracked` is accepted for the old signature: tensors alive before the step are not counted.
    """
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, out
    run, out = allocation_trace(step)
    return max(run, default=0), out


def allocation_trace(step) -> tuple[list[int], object]:
    """The running sum of allocated bytes after every allocation event of step() (for plots, tests)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    run, cur = [], 0
    for e in events:
        cur += e.nbytes()
        run.append(cur)
    return run, out
