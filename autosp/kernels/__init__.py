"""autosp's kernels: causal flash attention (Triton, GQA, LSE out) and the Ulysses layout kernels.

Importing this package never imports a Triton kernel module: those load on the
first call that picks the Triton path, so CPU-only and Triton-less machines
work (through the torch fallbacks). Importing it registers the custom ops
`autosp::flash_attention` and `autosp::flash_attention_backward` (with fakes,
autograd and flop formulas).
"""
from autosp.kernels._triton import triton_available
from autosp.kernels.a2a import (ulysses_pack, ulysses_pack_out, ulysses_unpack, ulysses_unpack_heads,
                                ulysses_unpack_out)
from autosp.kernels.flash_attention import flash_attention

__all__ = [
    "flash_attention",
    "triton_available",
    "ulysses_pack",
    "ulysses_pack_out",
    "ulysses_unpack",
    "ulysses_unpack_heads",
    "ulysses_unpack_out",
]
