"""Lazy access to Triton, and a `jit` that runs one kernel on GPU and CPU tensors.

Nothing here imports triton at module import time: `autosp.kernels` must import on
machines without triton or without a GPU. The kernel modules (`flash_fwd`,
`flash_bwd`, `a2a_triton`) import triton at their top and are themselves only
imported once a Triton path is chosen.

Why a custom `jit`: Triton decides between compiling and interpreting when
`@triton.jit` runs, from `TRITON_INTERPRET`. We want `backend="triton"` to work
on CPU tensors (through the interpreter, the only way to test kernels without a
GPU) and on GPU tensors (compiled) in the same process, whatever the
environment said at import time. So each kernel is a `JITFunction` that, for
CPU tensors, hands the launch to an `InterpretedFunction` of the same Python
function. Device functions (helpers called from kernels) work in both modes:
the compiler sees a `JITFunction`; the interpreter calls it, and the call goes
to the interpreted twin.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    """Whether `import triton` works here (it may be absent, or broken)."""
    try:
        if importlib.util.find_spec("triton") is None:
            return False
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install is as good as none: fall back to torch
        return False
    return True


def interpret_forced() -> bool:
    """TRITON_INTERPRET=1 in the environment: every kernel runs in the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_version() -> str:
    import triton

    return triton.__version__


def launch_device(t: torch.Tensor):
    """The context to launch kernels on t in: its own GPU (Triton launches on the current device,
    which need not be the one a second GPU's tensors live on)."""
    if t.device.type == "cuda" and t.device.index is not None:
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def check_grid(grid: tuple, what: str) -> tuple:
    """CUDA's grid: axis 0 up to 2**31 - 1, axes 1 and 2 up to 65535 (the kernels put heads on
    axis 0 and sequence tiles on axis 1)."""
    if grid[0] >= 2**31 or any(g > 65535 for g in grid[1:]):
        from autosp.errors import AutospError
        raise AutospError(f"autosp.kernels: {what} needs a launch grid of {grid}, beyond CUDA's (2**31 - 1, 65535, "
                          "65535). Fix: a larger block size for this length (config.override), or split the batch")
    return grid


def device_name(device: torch.device) -> str:
    """The name the config cache is keyed by ("NVIDIA H200", "cpu-interpreter")."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-interpreter"


@functools.cache
def interpreter_problem() -> str | None:
    """Why the Triton interpreter cannot run kernels on CPU tensors here, or None.

    Found by running a tiny kernel once: e.g. Triton 3.6's interpreter calls int() on
    1-element arrays, which numpy >= 2.4 refuses."""
    if not triton_available():
        return "triton is not installed"
    try:
        from autosp.kernels._tl import probe_interpreter

        probe_interpreter()
    except Exception as e:  # any failure means: do not trust the interpreter here
        return (f"the Triton {triton_version()} interpreter fails on this machine ({type(e).__name__}: "
                f"{str(e)[:200]}); known cause: Triton <= 3.6 with numpy >= 2.4")
    return None


@functools.cache
def _dual_jit_class():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    class DualJITFunction(JITFunction):
        """A JITFunction that interprets launches on CPU tensors (see module docstring)."""

        def _interpreted(self):
            twin = self.__dict__.get("_autosp_twin")
            if twin is None:
                twin = self.__dict__["_autosp_twin"] = InterpretedFunction(self.fn)
            return twin

        def run(self, *args, grid, warmup, **kwargs):
            if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
                return self._interpreted().run(*args, grid=grid, warmup=warmup, **kwargs)
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)

        def __call__(self, *args, **kwargs):
            # Only reached when an interpreted kernel calls this device function.
            return self._interpreted()(*args, **kwargs)

    return DualJITFunction


def jit(fn):
    """`triton.jit` for autosp's kernels: compiled on GPU tensors, interpreted on CPU ones."""
    import triton

    if interpret_forced():  # triton's own behaviour: everything interpreted
        return triton.jit(fn)
    return _dual_jit_class()(fn)
