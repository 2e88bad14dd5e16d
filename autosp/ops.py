"""autosp's non-collective custom ops: the attention masks padding needs."""
from __future__ import annotations

import torch
from torch import Tensor


def _padded_mask(mask: Tensor | None, length: int, padded: int, device, dtype) -> Tensor:
    """[.., padded, padded]: `mask` (or all-allowed) on real positions; padded keys blocked;
    each padded query sees only itself, so no softmax row is empty (no NaN into the backward)."""
    lead = list(mask.shape[:-2]) if mask is not None else []
    is_bool = dtype == torch.bool
    blocked = False if is_bool else float("-inf")
    allowed = True if is_bool else 0.0
    out = torch.full(lead + [padded, padded], blocked, dtype=dtype, device=device)
    if mask is not None:
        out[..., :length, :length] = mask
    else:
        out[..., :length, :length] = allowed
    idx = torch.arange(length, padded, device=device)
    out[..., idx, idx] = allowed
    return out


@torch.library.custom_op("autosp::pad_attn_mask", mutates_args=())
def pad_attn_mask(mask: Tensor, padded: int) -> Tensor:
    return _padded_mask(mask, mask.shape[-1], padded, mask.device, mask.dtype)


@pad_attn_mask.register_fake
def _(mask, padded):
    return mask.new_empty(list(mask.shape[:-2]) + [padded, padded])


@torch.library.custom_op("autosp::key_padding_mask", mutates_args=())
def key_padding_mask(length: int, padded: int, device: torch.device) -> Tensor:
    return _padded_mask(None, length, padded, device, torch.bool)


@key_padding_mask.register_fake
def _(length, padded, device):
    return torch.empty(padded, padded, dtype=torch.bool, device=device)


# ---------------------------------------------------------------- grouped matmul (MoE experts)
# aten._grouped_mm's fake kernel accepts bf16 only (CUDA's kernel), while the CPU kernel runs fp32 and
# fp16 too. Tracing maps the (M, K) x (G, K, N) form onto this op (autosp/decompositions.py): a fake
# kernel for every dtype, the same torch kernel when it runs, and a backward made of two more calls
# to it, so nothing between trace and run materialises a weight per row.

@torch.library.custom_op("autosp::grouped_mm", mutates_args=())
def grouped_mm(mat_a: Tensor, mat_b: Tensor, offs: Tensor) -> Tensor:
    """mat_a (M, K), rows grouped by offs (G cumulative ends, int32) @ mat_b (G, K, N) -> (M, N)."""
    return torch._grouped_mm(mat_a, mat_b, offs=offs).contiguous()   # the fake's strides (compiled code asserts)


@grouped_mm.register_fake
def _(mat_a, mat_b, offs):
    return mat_a.new_empty(mat_a.shape[0], mat_b.shape[-1])


@torch.library.custom_op("autosp::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(grad: Tensor, mat_a: Tensor, mat_b: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    # rows of group g: d mat_a = grad @ mat_b[g].T; d mat_b[g] = mat_a[rows].T @ grad[rows] (zero if empty)
    grad_a = torch._grouped_mm(grad, mat_b.transpose(-2, -1), offs=offs)
    grad_b = torch._grouped_mm(mat_a.transpose(0, 1), grad, offs=offs)
    return grad_a.contiguous(), grad_b.contiguous()          # the fake's strides (compiled code asserts them)


@grouped_mm_backward.register_fake
def _(grad, mat_a, mat_b, offs):
    return mat_a.new_empty(mat_a.shape), mat_b.new_empty(mat_b.shape)


def _grouped_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_grad(ctx, grad):
    mat_a, mat_b, offs = ctx.saved_tensors
    grad_a, grad_b = grouped_mm_backward(grad.contiguous(), mat_a, mat_b, offs)
    return grad_a, grad_b, None


grouped_mm.register_autograd(_grouped_mm_grad, setup_context=_grouped_mm_setup)


def _register_flop_formulas() -> None:
    """FLOPs for torch.utils.flop_counter (and the remat cost model): each row meets one matrix."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    fwd, bwd = torch.ops.autosp.grouped_mm, torch.ops.autosp.grouped_mm_backward
    if fwd not in flop_registry:
        @register_flop_formula(fwd)
        def _fwd_flops(a_shape, b_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
            return 2 * a_shape[0] * a_shape[1] * b_shape[-1]

    if bwd not in flop_registry:
        @register_flop_formula(bwd)
        def _bwd_flops(grad_shape, a_shape, b_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
            return 4 * a_shape[0] * a_shape[1] * b_shape[-1]


_register_flop_formulas()
