"""The fast kernels autosp declares as sequence ops, where their libraries are installed.

On GPUs, models run flash-linear-attention's gated delta rule, mamba_ssm's SSD scan and causal_conv1d's
convolution; a trace cannot enter them. Importing this module declares each entry point whose library
imports (`autosp.sequence_op`, with layouts, a fake from the layouts and the library's own backward
under autograd) and records why the others are missing. Nothing in the libraries or in transformers is
patched: the user's code (or a kernel hub) calls the declared op instead of the library function:

    from autosp.kernels.sequence_ops import kernel
    gdr = kernel("fla.chunk_gated_delta_rule")          # AutospError naming the package if it is absent
    o = gdr(q, k, v, g, beta, scale, False)             # q, k [b s h dk], v [b s h dv], g, beta [b s h]

On CPU the models' own torch code runs and autosp finds its regions from the trace; these declarations
only matter where the kernels exist. Each wrapper pins the library's optional arguments that a
sequence op cannot carry (initial and final states, packed-sequence offsets): a state crosses the
sequence, which the all-to-all around the op does not.
"""
import importlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from autosp.errors import AutospError
from autosp.sequence_op import SequenceOp, sequence_op


@dataclass(frozen=True)
class KernelEntry:
    name: str                                   # what `kernel(name)` takes
    package: str                                # what to install
    module: str
    attr: str
    declare: Callable[[Callable, str], Callable]   # (the library function, the op name) -> the declared op


def _gated_delta_rule(lib, name) -> SequenceOp:
    def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: float, use_qk_l2norm_in_kernel: bool) -> torch.Tensor:
        o, _ = lib(q, k, v, g=g, beta=beta, scale=scale, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return o
    return sequence_op(chunk_gated_delta_rule, name=name, fake="layouts", backward="autograd",
                       layouts="b s h dk, b s h dk, b s h dv, b s h, b s h -> b s h dv")


def _mamba_chunk_scan(lib, name) -> Callable:
    def mamba_chunk_scan_combined(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                                  C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, chunk_size: int,
                                  dt_softplus: bool, dt_min: float, dt_max: float) -> torch.Tensor:
        return lib(x, dt, A, B, C, chunk_size, D=D, z=None, dt_bias=dt_bias, dt_softplus=dt_softplus,
                   dt_limit=(dt_min, dt_max))
    op = sequence_op(mamba_chunk_scan_combined, name=name, fake="layouts", backward="autograd",
                     layouts="b s h p, b s h, h, b s g n, b s g n, h, h -> b s h p")

    def call(x, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus=False, dt_min=0.0, dt_max=float("inf")):
        # B and C are read whole by every rank; the kernel maps a rank's heads to groups by their count,
        # which only agrees with the whole model's mapping for one group
        if B.shape[2] != 1:
            raise AutospError(
                f"autosp.kernels.sequence_ops {name}: B {list(B.shape)} has {B.shape[2]} groups; with heads "
                "split over sp the kernel would pair this rank's heads with the wrong groups. Fix: repeat B "
                "and C to one group per head (B.repeat_interleave(heads // groups, dim=2)), or run the "
                "model's torch path.")
        return op(x, dt, A, B, C, D, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    call.declaration = op.declaration
    return call


def _causal_conv1d(lib, name) -> SequenceOp:
    def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         activation: Optional[str]) -> torch.Tensor:
        return lib(x, weight, bias, activation=activation)
    # depthwise: channels independent, so the channels split (a halo exchange would move less; this
    # keeps the kernel whole)
    return sequence_op(causal_conv1d_fn, name=name, fake="layouts", backward="autograd", split="c",
                       layouts="b c s, c w, c -> b c s")


TABLE = (
    KernelEntry("fla.chunk_gated_delta_rule", "flash-linear-attention", "fla.ops.gated_delta_rule",
                "chunk_gated_delta_rule", _gated_delta_rule),
    KernelEntry("mamba_ssm.mamba_chunk_scan_combined", "mamba-ssm", "mamba_ssm.ops.triton.ssd_combined",
                "mamba_chunk_scan_combined", _mamba_chunk_scan),
    KernelEntry("causal_conv1d.causal_conv1d_fn", "causal-conv1d", "causal_conv1d", "causal_conv1d_fn",
                _causal_conv1d),
)

KERNELS: dict[str, Callable] = {}         # name -> the declared op, for the libraries that import
MISSING: dict[str, str] = {}              # name -> why it is not declared


def load(entry: KernelEntry, op_name: str | None = None):
    """Declare one entry if its library imports: (the op, None) or (None, the reason)."""
    try:
        lib = getattr(importlib.import_module(entry.module), entry.attr)
    except Exception as exc:  # noqa: BLE001 - an absent or broken install: the torch path runs instead
        return None, f"{entry.package} is not importable ({type(exc).__name__}: {exc})"
    return entry.declare(lib, op_name or entry.name.replace(".", "_")), None


for _entry in TABLE:
    _op, _why = load(_entry)
    if _op is not None:
        KERNELS[_entry.name] = _op
    else:
        MISSING[_entry.name] = _why


def kernel(name: str):
    """The declared op for a library entry point, or an AutospError that says how to get it."""
    if name in KERNELS:
        return KERNELS[name]
    if name in MISSING:
        entry = next(e for e in TABLE if e.name == name)
        raise AutospError(f"autosp.kernels.sequence_ops: {name} is not declared: {MISSING[name]}. Fix: pip install "
                          f"{entry.package} on a machine with its GPU, or call the model's torch code (which autosp "
                          "shards from its trace).")
    raise AutospError(f"autosp.kernels.sequence_ops: no entry {name!r}; the table holds "
                      f"{', '.join(e.name for e in TABLE)}. Fix: declare your own kernel with autosp.sequence_op.")
