"""`autosp::flash_attention`: the custom op, its fake, its autograd, and the user wrapper.

    out = flash_attention(q, k, v, causal=True, scale=None, backend="auto")
    out, lse = torch.ops.autosp.flash_attention(q, k, v, causal, scale, backend)

q [b, hq, s, d]; k, v [b, hkv, s, d] with hq % hkv == 0 (GQA: query head h
attends with KV head h // (hq // hkv), as SDPA's enable_gqa). lse is the
natural-log logsumexp of the scaled scores, fp32 [b, hq, s] (fp64 for fp64
inputs). Both outputs are contiguous, in the real and the fake implementation.

Being one custom op with a fake, tracing (make_fx over fake tensors), the IR and
remat see a single attention op whose saved state is exactly (q, k, v, out,
lse); the backward is a second op, `autosp::flash_attention_backward`, with its
own fake, so a traced joint graph holds it as one node too.

Backends: "triton" runs the Triton kernels (compiled on GPU tensors, the Triton
interpreter on CPU tensors); "torch" runs SDPA's own kernels or exact math
(flash_torch.py); "auto" is Triton on CUDA/ROCm tensors when the shape and dtype
allow it, torch otherwise. Head dims that are not a power of two in [16, 256]
are zero-padded for Triton (zeros change neither scores nor the kept columns).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from autosp.errors import AutospError
from autosp.kernels import config
from autosp.kernels._triton import interpreter_problem, triton_available
from autosp.kernels.flash_torch import lse_dtype, torch_backward, torch_forward

BACKENDS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TRITON_HEAD_DIM = 256


def _shapes(q, k, v) -> str:
    return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"


_CHECKED: set = set()     # signatures already checked: a training step calls with the same few


def check_inputs(q, k, v, causal, scale, backend) -> None:
    """Raise AutospError naming the shapes and the fix for anything the op does not take.
    A signature (shapes, dtypes, devices, flags) is checked once per process."""
    try:
        sig = tuple((tuple(t.shape), t.dtype, t.device) for t in (q, k, v)) + (
            type(causal), causal, type(scale), scale, backend)
        if sig in _CHECKED:
            return
    except (AttributeError, TypeError):      # not tensors, or unhashable: the checks below say what
        sig = None
    _check_inputs(q, k, v, causal, scale, backend)
    if sig is not None:
        if len(_CHECKED) > 4096:
            _CHECKED.clear()
        _CHECKED.add(sig)


def _check_inputs(q, k, v, causal, scale, backend) -> None:
    op = "autosp.flash_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise AutospError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise AutospError(f"{op}: {_shapes(q, k, v)}: {name} must be 4-D [batch, heads, seq, head_dim]; "
                              f"for [batch, seq, heads, head_dim] inputs pass {name}.transpose(1, 2)")
    b, hq, s, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise AutospError(f"{op}: {_shapes(q, k, v)}: k and v must be [b, hkv, s, d] with q's b, s and d; "
                          f"pad or slice them to one sequence length (for cross-attention use torch SDPA)")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise AutospError(f"{op}: {_shapes(q, k, v)}: query heads ({hq}) must be a multiple of key/value "
                          f"heads ({hkv}) for grouped-query attention; repeat k/v heads to a divisor of {hq}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise AutospError(f"{op}: {_shapes(q, k, v)}: dtypes {q.dtype}, {k.dtype}, {v.dtype}: q, k, v must "
                          f"share one floating dtype; cast them with .to(q.dtype)")
    if not (q.device == k.device == v.device):
        raise AutospError(f"{op}: {_shapes(q, k, v)}: devices {q.device}, {k.device}, {v.device}: move q, k, v "
                          f"to one device")
    if not isinstance(causal, bool):
        raise AutospError(f"{op}: causal must be a bool, got {causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise AutospError(f"{op}: scale must be None or a finite float, got {scale!r}")
    if backend not in BACKENDS:
        raise AutospError(f"{op}: backend {backend!r} unknown; use one of {BACKENDS}")


def triton_unsupported(q: torch.Tensor) -> Optional[str]:
    """Why the Triton kernels cannot run these inputs, with the fix; None if they can."""
    if not triton_available():
        return "triton is not installed (or fails to import); pip install triton, or use backend='torch'"
    if q.device.type not in ("cuda", "cpu"):
        return f"Triton runs on CUDA/ROCm (or CPU via its interpreter), not {q.device.type}; use backend='torch'"
    if q.dtype not in TRITON_DTYPES:
        return f"dtype {q.dtype} is not one of {TRITON_DTYPES}; cast, or use backend='torch'"
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        return ("bfloat16 is broken in the Triton interpreter that runs CPU tensors; use float16/float32 on CPU, "
                "a GPU, or backend='torch'")
    if q.device.type == "cpu" and interpreter_problem() is not None:
        return f"{interpreter_problem()}; use backend='torch' on CPU"
    if q.shape[-1] > MAX_TRITON_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {MAX_TRITON_HEAD_DIM} does not fit the kernel's tiles; use backend='torch'"
    return None


def resolve_backend(q: torch.Tensor, k, v, backend: str) -> str:
    """"triton" or "torch" for these inputs (see the module docstring)."""
    if backend == "torch":
        return "torch"
    why = triton_unsupported(q)
    if backend == "triton":
        if why is not None:
            raise AutospError(f"autosp.flash_attention(backend='triton'): {_shapes(q, k, v)}, {q.dtype} on "
                              f"{q.device}: {why}")
        return "triton"
    return "triton" if why is None and q.device.type == "cuda" else "torch"


def _resolve_scale(scale: Optional[float], d: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(d)


def _padded_head_dim(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _pad(t: torch.Tensor, dp: int) -> torch.Tensor:
    return t if t.shape[-1] == dp else F.pad(t, (0, dp - t.shape[-1]))


def _triton_forward(q, k, v, causal, scale):
    from autosp.kernels.flash_fwd import attention_forward

    d = q.shape[-1]
    dp = _padded_head_dim(d)
    cfg = config.lookup("flash_fwd", q.device, q.dtype, dp, causal, q.shape[2])
    out, lse = attention_forward(_pad(q, dp), _pad(k, dp), _pad(v, dp), causal, scale, cfg)
    return (out if dp == d else out[..., :d].contiguous()), lse


def _triton_backward(do, q, k, v, out, lse, dlse, causal, scale):
    from autosp.kernels.flash_bwd import attention_backward

    d = q.shape[-1]
    dp = _padded_head_dim(d)
    cfg = config.lookup("flash_bwd", q.device, q.dtype, dp, causal, q.shape[2])
    grads = attention_backward(_pad(do, dp), _pad(q, dp), _pad(k, dp), _pad(v, dp), _pad(out, dp), lse, dlse,
                               causal, scale, cfg)
    return tuple(g if dp == d else g[..., :d].contiguous() for g in grads)


def _empty_outputs(q):
    b, hq, s, d = q.shape
    return q.new_empty((b, hq, s, d)), q.new_empty((b, hq, s), dtype=lse_dtype(q.dtype))


@torch.library.custom_op("autosp::flash_attention", mutates_args=())
def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float],
                       backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs(q, k, v, causal, scale, backend)
    which = resolve_backend(q, k, v, backend)
    if q.numel() == 0:  # no rows, no programs: Triton cannot launch an empty grid
        out, lse = _empty_outputs(q)
        return out.zero_(), lse.fill_(float("-inf"))
    sc = _resolve_scale(scale, q.shape[-1])
    if which == "triton":
        return _triton_forward(q, k, v, causal, sc)
    return torch_forward(q, k, v, causal, sc)


@flash_attention_op.register_fake
def _flash_attention_fake(q, k, v, causal, scale, backend):
    check_inputs(q, k, v, causal, scale, backend)
    return _empty_outputs(q)


@torch.library.custom_op("autosp::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        dlse: Optional[torch.Tensor], causal: bool, scale: Optional[float],
        backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs(q, k, v, causal, scale, backend)
    if dout.shape != q.shape or lse.shape != q.shape[:3]:
        raise AutospError(f"autosp.flash_attention_backward: {_shapes(q, k, v)}, dout {tuple(dout.shape)}, "
                          f"lse {tuple(lse.shape)}: dout must be q's shape and lse [b, hq, s]; pass the forward's "
                          f"outputs unchanged")
    if q.numel() == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    which = resolve_backend(q, k, v, backend)
    sc = _resolve_scale(scale, q.shape[-1])
    dout = dout.to(q.dtype)
    if which == "triton":
        return _triton_backward(dout, q, k, v, out, lse, dlse, causal, sc)
    return torch_backward(dout, q, k, v, out, lse, dlse, causal, sc)


@flash_attention_backward_op.register_fake
def _flash_attention_backward_fake(dout, q, k, v, out, lse, dlse, causal, scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
    ctx.set_materialize_grads(False)  # an unused LSE must cost nothing in the backward


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None and dlse is None:
        return None, None, None, None, None, None
    if dout is None:
        dout = torch.zeros_like(out)
    # The backward op has no derivative of its own (no double backward); under no_grad it
    # also skips the autograd layer that torch.func transforms reject.
    with torch.no_grad():
        dq, dk, dv = torch.ops.autosp.flash_attention_backward(dout, q, k, v, out, lse, dlse, ctx.causal,
                                                               ctx.scale, ctx.backend)
    return dq, dk, dv, None, None, None


flash_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _FlashAttention(torch.autograd.Function):
    """The same op and autograd as a Function with `setup_context`: torch.func (grad, vjp)
    refuses custom ops' own autograd, but takes this; make_fx still records the two ops."""

    @staticmethod
    def forward(q, k, v, causal, scale, backend):
        return torch.ops.autosp.flash_attention(q, k, v, causal, scale, backend)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: Optional[float] = None, backend: str = "auto") -> torch.Tensor:
    """Attention of q [b, hq, s, d] over k, v [b, hkv, s, d] (GQA when hkv < hq); differentiable.

    `scale` defaults to 1/sqrt(d). See the module docstring for the backends."""
    check_inputs(q, k, v, causal, scale, backend)  # errors name this call, not the op's internals
    scale = None if scale is None else float(scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _FlashAttention.apply(q, k, v, causal, scale, backend)[0]
    return torch.ops.autosp.flash_attention(q, k, v, causal, scale, backend)[0]  # no autograd overhead


def _attention_pairs(s: int, causal: bool) -> int:
    return s * (s + 1) // 2 if causal else s * s


def _register_flop_formulas() -> None:
    """FLOPs for torch.utils.flop_counter (and the remat cost model): 2 matmuls forward, 5 backward
    (P is recomputed), over the unmasked (query, key) pairs only."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    fwd, bwd = torch.ops.autosp.flash_attention, torch.ops.autosp.flash_attention_backward
    if fwd not in flop_registry:
        @register_flop_formula(fwd)
        def _fwd_flops(q_shape, k_shape, v_shape, causal, *args, out_shape=None, **kwargs) -> int:
            b, hq, s, d = q_shape
            return 4 * b * hq * d * _attention_pairs(s, causal)

    if bwd not in flop_registry:
        @register_flop_formula(bwd)
        def _bwd_flops(dout_shape, q_shape, k_shape, v_shape, o_shape, lse_shape, dlse_shape, causal, *args,
                       out_shape=None, **kwargs) -> int:
            b, hq, s, d = q_shape
            return 10 * b * hq * d * _attention_pairs(s, causal)


_register_flop_formulas()
