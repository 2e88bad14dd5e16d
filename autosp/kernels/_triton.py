"""Whether and how Triton runs here: lazy kernels, the interpreter, launches, and the backend choice.

Nothing here imports triton at module import time: `autosp.kernels` must import on
machines without triton. A kernel module marks its Triton functions with `@kernel`
(they stay plain Python functions) and keeps `tl = None` at its top;
`jit_module(globals())`, called by its launchers on the first Triton call, imports
triton, binds `tl` and replaces every marked function by its `triton.jit`. Kernels
call each other through the module's globals, so the compiler and the interpreter
both find the jitted versions.

CPU tensors run through Triton's own interpreter, chosen the only way Triton offers:
`TRITON_INTERPRET=1` in the environment before triton is first imported (`import autosp`
imports it, through torch's flop counter; tests/conftest.py sets it on machines without
a GPU). Triton fixes the mode when it is imported and when a function is jitted, so one
process either interprets every kernel or compiles every kernel: `backend="triton"` on
CPU tensors without the variable is an AutospError saying so, and with it "auto" never
picks Triton. Verified on Triton 3.9 (CPU): tl.max/tl.sum/tl.zeros work in interpreted
kernels only when the variable was set before triton's import, which is why it must go
first and why `interpreter_problem` checks it. Triton 3.6 (the GPU image) decides the mode
the same way (its `jit` returns an InterpretedFunction under the variable) but was not run
here; there the GPU tests run compiled, without the variable, and its interpreter is known
to fail with numpy >= 2.4 (`interpreter_problem` finds that too).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading

import torch

from autosp.errors import AutospError

BACKENDS = ("auto", "triton", "torch")
tl = None  # triton.language: bound by jit_module(globals()) with the probe kernel below


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


def interpreting() -> bool:
    """TRITON_INTERPRET=1 in the environment: every kernel runs in Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_version() -> str:
    import triton

    return triton.__version__


# ---------------------------------------------------------------- lazy kernels


def kernel(fn):
    """Mark a Triton kernel or device function of a module; `jit_module` jits it (module docstring)."""
    fn.__autosp_kernel__ = True
    return fn


_jit_lock = threading.Lock()


def jit_module(namespace: dict) -> None:
    """Import triton, bind `tl` in a kernel module's globals and jit its `@kernel` functions; once."""
    if namespace.get("__autosp_jitted__"):
        return
    with _jit_lock:
        if namespace.get("__autosp_jitted__"):
            return
        import triton
        import triton.language

        namespace["tl"] = triton.language  # first: jit may read the (string) annotations
        for name, fn in list(namespace.items()):
            if getattr(fn, "__autosp_kernel__", False) and getattr(fn, "__module__", None) == namespace["__name__"]:
                namespace[name] = triton.jit(fn)
                if interpreting() and hasattr(namespace[name], "rewrite"):
                    namespace[name] = _Interpreted(namespace[name])
        namespace["__autosp_jitted__"] = True


class _Interpreted:
    """An interpreted Triton function whose calls from another kernel run its rewritten body directly. Triton's
    interpreter (3.9) patches every builtin of triton.language again on each such call (`inspect.getmembers` of
    the module, its tensor and math: a no-op once the launch has patched them, which it has), over a quarter of an
    interpreted attention's time (bench/interpreter_calls.py); a launch (`f[grid](...)`) is Triton's own."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn[grid]

    def __call__(self, *args, **kwargs):
        return self.fn.rewrite()(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fn, name)


# ---------------------------------------------------------------- launches


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
        raise AutospError(f"autosp.kernels: {what} needs a launch grid of {grid}, beyond CUDA's (2**31 - 1, 65535, "
                          "65535). Fix: a larger block size for this length (config.override), or split the batch")
    return grid


def device_name(device: torch.device) -> str:
    """The name the config cache is keyed by ("NVIDIA H200", "cpu-interpreter")."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-interpreter"


# ---------------------------------------------------------------- the interpreter


@kernel
def _probe(X, n):
    # what the kernels need from the interpreter: a loop with a runtime bound, library reductions
    acc = tl.zeros([16], dtype=tl.float32)
    for _ in range(0, n, 1):
        acc += 1.0
    tl.store(X + tl.arange(0, 16), acc + tl.max(acc[:, None] * 0.0, 1) + tl.sum(acc[:, None] * 0.0, 1))


def interpreter_problem() -> str | None:
    """Why the Triton interpreter cannot run kernels on CPU tensors here (ending with the fix), or None."""
    if not triton_available():
        return "triton is not installed (or fails to import); pip install triton, or use backend='torch'"
    if not interpreting():
        return ("Triton runs CPU tensors only in its interpreter: set TRITON_INTERPRET=1 before anything imports "
                "triton (`import autosp` does, through torch's flop counter), or use backend='torch'")
    return _probe_interpreter()


@functools.cache
def _probe_interpreter() -> str | None:
    # once per process: a tiny kernel through the interpreter
    import triton.language
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.sum, InterpretedFunction):  # the library was jitted for compiling
        return ("TRITON_INTERPRET=1 was set after triton was imported; set it before (before `import autosp`, "
                "which imports triton through torch's flop counter), or use backend='torch'")
    try:
        jit_module(globals())
        x = torch.zeros(16)
        _probe[(1,)](x, 3)
        if not bool((x == 3).all()):
            raise RuntimeError(f"probe kernel computed {x.tolist()}, expected 3s")
    except Exception as e:  # any failure means: do not trust the interpreter here
        return (f"the Triton {triton_version()} interpreter fails on this machine ({type(e).__name__}: "
                f"{str(e)[:200]}; known cause: Triton <= 3.6 with numpy >= 2.4); use backend='torch' on CPU")
    return None


# ---------------------------------------------------------------- the backend choice


def triton_problem(t: torch.Tensor) -> str | None:
    """Why Triton cannot run on t's device and dtype here (ending with the fix), or None."""
    if not triton_available():
        return "triton is not installed (or fails to import); pip install triton, or use backend='torch'"
    if t.device.type not in ("cuda", "cpu"):
        return f"Triton runs on CUDA/ROCm (or CPU via its interpreter), not {t.device.type}; use backend='torch'"
    if t.device.type == "cpu" or interpreting():
        if t.dtype == torch.bfloat16:
            return ("bfloat16 is broken in the Triton interpreter that runs CPU tensors; use float16/float32 "
                    "on CPU, a GPU, or backend='torch'")
        return interpreter_problem()
    return None


def resolve_backend(op: str, backend: str, t: torch.Tensor, unsupported: str | None = None) -> str:
    """"triton" or "torch" for a call of autosp.`op` on tensors like t.

    "torch" always works; "triton" raises AutospError naming why it cannot run here; "auto" is
    Triton on CUDA/ROCm tensors when it can run there and is not being interpreted, torch otherwise.
    `unsupported`: why the op's own kernel cannot take these inputs (dtype, head dim), or None."""
    if backend not in BACKENDS:
        raise AutospError(f"autosp.{op}: backend {backend!r} unknown; use one of {BACKENDS}")
    if backend == "torch" or (backend == "auto" and (t.device.type != "cuda" or interpreting())):
        return "torch"
    why = triton_problem(t) or unsupported
    if backend == "triton" and why is not None:
        raise AutospError(f"autosp.{op}(backend='triton'): {t.dtype} tensors on {t.device}: {why}")
    return "triton" if why is None else "torch"
