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
