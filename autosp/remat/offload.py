"""Offload ops: a saved value leaves the device after its last forward use and comes back before
its first backward use.

On CUDA/ROCm the copies run on a side stream into pinned host memory, ordered after the
producer by an event; the backward's `wait` makes the compute stream wait for the copy back
right before the first use, so the transfer overlaps the equations in between. On CPU there
is no device to leave: the value is copied into a host buffer and back, so the rewritten
program is exercised (and its results tested) exactly as on a GPU. Host buffers on both come
from pools kept across steps (`_HostPool`; pinned for a GPU): a pinned allocation costs
milliseconds and serialises with the device. On CPU the host buffers come from numpy's allocator,
not torch's: what torch allocates stands for the device's memory (the profiler's allocation events
measure it), and the host copies stay out of it, as a GPU's pinned buffers stay out of its
allocator, so the memory model (device bytes only) is what is measured on both.

`deferred()` makes the CPU path as late as a GPU's side stream may be, to test on the CPU what only a GPU would
show: an offload's copy out happens only when the backward's first prefetch comes (its value must still hold what
it held: nothing may take its memory meanwhile, as inductor's buffer reuse would), and a prefetch returns NaN (an
integer's least value) that its copy back replaces only at the `wait` (a reader not behind its wait reads it).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch import Tensor

_side: dict[int, object] = {}          # device index -> its copy stream


def _stream(device: torch.device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _side:
        _side[idx] = torch.cuda.Stream(device=idx)
    return _side[idx]


class _HostPool:
    """Host buffers by (shape, dtype, strides, source device), reused once the tensor handed out is
    gone (a step's host copies die in its backward, so the next step finds them free). `pin`: the
    buffers are page-locked (a GPU's asynchronous copies need it; pinning needs CUDA)."""

    def __init__(self, pin: bool = False):
        self.pin = pin
        self.slots: dict[tuple, list] = {}       # key -> [(buffer, weakref to the tensor handed out)]

    def take(self, x: Tensor) -> Tensor:
        """A host tensor shaped like a clone of x (the backward's views of the copy rely on its
        strides), backed by a pooled buffer that no live tensor handed out before shares."""
        stride = torch.empty_like(x, device="meta").stride()          # a clone's strides
        slots = self.slots.setdefault((tuple(x.shape), x.dtype, stride, x.device), [])
        slot = next((k for k, (_, ref) in enumerate(slots) if ref() is None), None)
        if slot is None:
            buf = host_empty_strided(x.shape, stride, x.dtype, pin=self.pin)
            slots.append((buf, None))
            slot = len(slots) - 1
        buf = slots[slot][0]
        out = buf.detach()                        # a tensor of its own, sharing the pooled storage
        slots[slot] = (buf, weakref.ref(out))
        return out

    def copy(self, x: Tensor) -> Tensor:
        """A pooled host copy of x, written now (the CPU path)."""
        out = self.take(x)
        out.copy_(x)
        return out

    def nbytes(self) -> int:
        """Host bytes the pool holds (free or handed out)."""
        return sum(buf.nbytes for slots in self.slots.values() for buf, _ in slots)


def host_empty_strided(shape, stride, dtype: torch.dtype, *, pin: bool = False) -> Tensor:
    """An uninitialised host tensor: pinned by torch for a GPU's asynchronous copies; otherwise from numpy's
    allocator, outside the bytes torch allocates (which stand for the device's on CPU)."""
    if pin:
        return torch.empty_strided(shape, stride, dtype=dtype, device="cpu", pin_memory=True)
    import numpy as np
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(n > 0 for n in shape) else 0
    raw = torch.from_numpy(np.empty(max(span, 1) * dtype.itemsize, dtype=np.uint8))
    return raw.view(dtype).as_strided(tuple(shape), tuple(stride))


def host_empty(shape, dtype: torch.dtype, *, pin: bool = False) -> Tensor:
    """host_empty_strided, contiguous."""
    return host_empty_strided(shape, torch.empty(shape, dtype=dtype, device="meta").stride(), dtype, pin=pin)


_host_pool = _HostPool()                  # the CPU path's copies
_pinned_pool = _HostPool(pin=True)        # a GPU's; allocates (and pins) only when a GPU offloads


_late: list | None = None                 # deferred(): [(value, host copy) not yet copied out]
_landing: dict[int, tuple] = {}          # deferred(): data_ptr of a prefetched value -> (value, its host copy)


@contextlib.contextmanager
def deferred():
    """The CPU path's copies made as late as a GPU's asynchronous ones may be (the module's docstring): for tests."""
    global _late
    _late = []
    try:
        yield
    finally:
        _late = None
        _landing.clear()


def _copy_out_late() -> None:
    """deferred(): the offloads' copies out, due before anything reads their host copies."""
    while _late:
        x, host = _late.pop(0)
        host.copy_(x)


@torch.library.custom_op("autosp::offload", mutates_args=())
def offload(x: Tensor) -> Tensor:
    """A host copy of x (pinned, asynchronous on a side stream on CUDA; from a reused pool on both)."""
    if x.device.type != "cuda":
        if _late is not None:
            host = _host_pool.take(x)
            _late.append((x, host))       # x held, as the GPU's allocator holds it for the side stream
            return host
        return _host_pool.copy(x)
    side = _stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    # Reuse is safe without an event: the device touches a pooled buffer only on this side stream
    # (this copy writes it, prefetch's copy back reads it) and the host never reads it. The pool
    # hands a buffer out again only after the tensor it backed died, which is after the prefetch
    # that read it was enqueued on the side stream (the backward holds the host copy until then),
    # so this write, enqueued later on the same stream, runs after that read. The pool is keyed by
    # the device too: another device's side stream is not ordered with this one.
    host = _pinned_pool.take(x)
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
    x.record_stream(side)
    return host


@offload.register_fake
def _(x):                      # the real op's strides (a clone's: _HostPool.take), or compiled code's views fail
    return torch.empty_like(x, device="cpu")


@torch.library.custom_op("autosp::prefetch", mutates_args=())
def prefetch(h: Tensor, device: str) -> Tensor:
    """The host copy back on `device` (asynchronous on the side stream on CUDA; `wait` before use)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        if _late is not None:
            _copy_out_late()
            poison = (float("nan") if h.is_floating_point() else
                      torch.iinfo(h.dtype).min if h.dtype != torch.bool and not h.is_complex() else 0)
            out = torch.full_like(h, poison)
            _landing[out.data_ptr()] = (out, h)
            return out
        return h.clone()
    side = _stream(dev)
    with torch.cuda.stream(side):
        out = torch.empty_like(h, device=dev)                      # h's strides, as the CPU path's clone
        out.copy_(h, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    out.record_stream(torch.cuda.current_stream(dev))
    _pending[out.data_ptr()] = event
    return out


_pending: dict[int, object] = {}


@prefetch.register_fake
def _(h, device):
    return torch.empty_like(h, device=device)


@torch.library.custom_op("autosp::wait", mutates_args=("x",))
def wait(x: Tensor) -> None:
    """The compute stream waits for x's prefetch (nothing to wait for on CPU). Declared as writing x (the copy
    lands in it when the wait returns), as inflight.wait_collective writes its buffers: an op that returns
    nothing and writes nothing is dead code to a compiler (inductor dropped every wait of a compiled step's
    backward), and no reader of x may move above it."""
    if x.device.type != "cuda":
        landing = _landing.pop(x.data_ptr(), None)
        if landing is not None:
            x.copy_(landing[1])
        return
    event = _pending.pop(x.data_ptr(), None)
    if event is not None:
        torch.cuda.current_stream(x.device).wait_event(event)


@wait.register_fake
def _(x):
    return None
