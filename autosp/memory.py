"""Measured memory: the peak bytes a step allocates, above what was live before it or in all.

The profiler's allocation events (`profile_memory=True`) see every allocation through torch's
allocator, including those inside collectives, attention and autograd.grad; the running sum
of their sizes, in time order, peaks where the step does. (MemTracker misses op-internal
buffers and refuses torch.autograd.grad.) On CUDA the allocator's own counters are used.

`StepMeter` measures a training loop: each step's peak of allocated device bytes, model state
included. On CUDA: `torch.cuda.max_memory_allocated`, reset at every step. On CPU torch keeps no
such counter, so the profiler's allocation events are followed from before the model is built
(their running sum is then the bytes allocated in all) through the first `steps` steps, in one
profiler session per step so that each step's figure is known when it ends; later steps are not
measured (the profiler slows a step). Host buffers (autosp.remat.offload.host_empty: the offload
pool, ZeRO-Offload's state) come from numpy's allocator and are not among them, as a GPU's
pinned host memory is not among its allocator's bytes.

The profiler records an allocation's free only on a thread it profiles (its option to profile all threads
records no allocations at all, torch 2.13). gloo's worker threads free what a collective holds when they let
go of it, which may be after its caller did: autosp's collectives empty the handles they give gloo
(collectives._let_go), and `_Ledger` frees a buffer allocated inside a collective (a `c10d::` or `gloo:` op:
its flattened copies) whose free no session saw where the collective returned (the worker was done with it).
The Python objects autosp sends (a plan, the inputs' signatures) go the same way (collectives.broadcast_object,
all_gather_objects), and a checkpoint is loaded without DCP's coordination (its plans are such objects, sent with
torch's own): before the first step nothing is left to gloo's threads. DCP's save still coordinates, after the steps
measured unless `--save-every` is 1 or 2.
"""
from __future__ import annotations

import contextlib
import os
import sys

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


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's start and stop print `USDT ... profiler_start` lines on file descriptor 2, from C++:
    a user's terminal should not see them, so fd 2 points at /dev/null while it starts or stops."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


_COLLECTIVE = ("c10d::", "gloo:")           # the profiler's names of collectives' own ops


class _Ledger:
    """The allocations of consecutive profiler sessions, with the frees a collective's worker thread made (which
    the profiler does not record) put back where the collective returned."""

    def __init__(self):
        self.put_back: set[int] = set()      # pointers freed here on a worker's behalf: their late free is dropped

    def sizes(self, prof) -> list[int]:
        """The signed sizes of a closed session's allocation events (frees negative), in time order."""
        events = []                          # (time, bytes, pointer, end of the collective it was made in)

        def walk(ev, collective):
            f = ev.extra_fields
            if type(f).__name__ == "_ExtraFields_Allocation":
                events.append((ev.start_time_ns, int(f.alloc_size), int(f.ptr), collective))
                return
            if collective is None and ev.name.startswith(_COLLECTIVE):
                collective = ev.end_time_ns
            for c in ev.children:
                walk(c, collective)

        for root in prof.kineto_results.experimental_event_tree():
            walk(root, None)
        events.sort(key=lambda e: e[0])
        live: dict[int, tuple[int, int | None]] = {}
        kept = []
        for t, n, ptr, collective in events:
            if n > 0:
                live[ptr] = (n, collective)
                self.put_back.discard(ptr)
            elif ptr in self.put_back:       # freed by the worker, already put back: not twice
                self.put_back.discard(ptr)
                continue
            else:
                live.pop(ptr, None)
            kept.append((t, n))
        for ptr, (n, collective) in live.items():
            if collective is not None:       # a collective's own buffer, never freed where the profiler could see
                kept.append((collective, -n))
                self.put_back.add(ptr)
        kept.sort(key=lambda e: e[0])
        return [n for _, n in kept]


class _Session:
    """One profiler session recording allocation events, quiet on the terminal."""

    def __init__(self, ledger: _Ledger | None = None):
        # the autograd profiler that torch.profiler.profile wraps: entering that one asks hasattr(torch, "_inductor"),
        # which imports inductor and dynamo (2.4 s of every rank's first step)
        from torch.autograd.profiler import profile
        self.ledger = ledger or _Ledger()
        self.prof = profile(use_kineto=True, profile_memory=True, use_cpu=True)
        with _quiet_stderr():
            self.prof.__enter__()

    def close(self) -> list[int]:
        """The signed sizes of the session's allocation events (frees negative), in time order."""
        with _quiet_stderr():
            self.prof.__exit__(None, None, None)
        return self.ledger.sizes(self.prof)


def allocation_trace(step) -> tuple[list[int], object]:
    """The running sum of allocated bytes after every allocation event of step() (for plots, tests)."""
    session = _Session()
    try:
        out = step()
    finally:
        sizes = session.close()
    run, cur = [], 0
    for n in sizes:
        cur += n
        run.append(cur)
    return run, out


class StepMeter:
    """Each step's peak of allocated device bytes, everything allocated included (see the module docstring).

        meter = StepMeter(device, steps=3)      # before the model is built
        ...                                     # build the model, the optimizer
        meter.begin()                           # right before the first step
        for n in ...:
            ...                                 # the step
            peak = meter.lap()                  # its peak in bytes; None once the meter has stopped (CPU)
    """

    def __init__(self, device: torch.device, steps: int = 3):
        self.device = device
        self.cuda = device.type == "cuda"
        self.left = steps
        self.live = 0                        # CPU: bytes allocated in all at the start of the session
        self.session = None
        self.ledger = _Ledger()
        if not self.cuda and steps > 0:
            self.session = _Session(self.ledger)

    @property
    def kind(self) -> str:
        return ("torch.cuda.max_memory_allocated, every step" if self.cuda else
                "the profiler's allocation events, from before the model was built")

    def _close(self) -> int:
        """Close the CPU session; the peak of the running sum during it (and move `live` to its end)."""
        top = cur = self.live
        for n in self.session.close():
            cur += n
            top = max(top, cur)
        self.live = cur
        self.session = None
        return top

    def begin(self) -> None:
        """The first step starts now (what came before, the model's building, is not a step's)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.session is not None:
            self._close()
            self.session = _Session(self.ledger)

    def lap(self) -> int | None:
        """The peak of the step that ends now; the next one starts."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        if self.session is None:
            return None
        peak = self._close()
        self.left -= 1
        if self.left > 0:
            self.session = _Session(self.ledger)
        return peak

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
