"""autosp's kernels: causal flash attention (Triton, GQA, LSE out) and the Ulysses layout kernels.

One module per kernel family, in the Triton tutorials' layout (kernels, launchers,
custom ops, autograd): flash.py (attention, forward and backward) and ulysses.py
(the all-to-all layouts); flash_torch.py is attention's torch backend, reference.py
the float64 references and error bounds, config.py the launch-config cache reader.
Importing this package never imports triton: the kernels are jitted on the first
call that picks the Triton path, so CPU-only and Triton-less machines work (through
the torch backends). Importing it registers the custom ops `autosp::flash_attention`,
`autosp::flash_attention_backward` and `autosp::ulysses_*` (with fakes, autograd
and flop formulas).
"""
from autosp.kernels._triton import triton_available
from autosp.kernels.flash import flash_attention
from autosp.kernels.ulysses import (ulysses_pack, ulysses_pack_out, ulysses_unpack, ulysses_unpack_heads,
                                    ulysses_unpack_out)

__all__ = [
    "flash_attention",
    "triton_available",
    "ulysses_pack",
    "ulysses_pack_out",
    "ulysses_unpack",
    "ulysses_unpack_heads",
    "ulysses_unpack_out",
]

from autosp.kernels.masked import masked_attention  # registers autosp::masked_attention(_backward)

__all__ += ["masked_attention"]
