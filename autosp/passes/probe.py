"""Rules from semantics: how the sequence passes through an op that no rule names.

Two probes, both on small tensors, cached per op and argument signature:

- `shape_links` (for seqdims): grow every input dim of one size together and watch which output
  dims grow with them, on fake tensors (no memory). A dim that grows alone with exactly one
  output dim is the same dim;
- `is_positionwise` (for the sharding rule): run the op on random real inputs whose sequence
  dims hold n positions, and again on a window of m < n of them (a prefix and a suffix); the op
  is position-wise along the sequence iff each result is the same window of the first. An op that
  mixes positions (a scan, a sort, a contraction over the sequence) fails this, and the error
  says so instead of claiming a missing rule.

Ops with size arguments (int lists: views, factories) are not probed: their sizes would have
to change with the probe, which only a hand rule knows how to do.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autosp.ir.core import Eqn, Var

_GROW = 7          # added to a probed size: unlikely to coincide with any other dim
_CACHE: dict = {}


def probeable(e: Eqn) -> bool:
    """An aten (or custom) op whose non-tensor arguments are not sizes."""
    if not isinstance(e.op.target, torch._ops.OpOverload) or not e.outputs:
        return False

    def sizes(a) -> bool:
        if isinstance(a, (list, tuple)):
            return any(isinstance(x, int) and not isinstance(x, bool) for x in a) or any(sizes(x) for x in a)
        return False
    args, kwargs = e.var_args()
    return not any(sizes(a) for a in list(args) + list(kwargs.values()))


def _run(e: Eqn, values):
    args, kwargs = e.bind(values)
    out = e.op.target(*args, **kwargs)
    return list(out) if e.multi else [out]


def shape_links(e: Eqn) -> list[tuple[Var, int, Var, int]]:
    """(input, dim, output, dim) pairs that index the same positions, by growing sizes on fakes."""
    if not probeable(e):
        return []
    key = ("links", e.op.target, tuple((x.dtype, x.shape) for x in e.inputs), repr(e.args), repr(e.kwargs))
    if key in _CACHE:
        return [(e.inputs[i], d, e.outputs[j], k) for i, d, j, k in _CACHE[key]]
    found = []
    sizes = sorted({s for x in e.inputs for s in x.shape if s > 1})
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode:
            base = _run(e, [torch.empty(x.shape, dtype=x.dtype) for x in e.inputs])
            for n in sizes:
                grown = [torch.empty([s + _GROW if s == n else s for s in x.shape], dtype=x.dtype) for x in e.inputs]
                try:
                    outs = _run(e, grown)
                except Exception:  # noqa: BLE001 - this size does not follow through the op
                    continue
                changed = [(j, k) for j, (o, b) in enumerate(zip(outs, base)) if isinstance(o, torch.Tensor)
                           for k in range(min(o.ndim, b.ndim)) if o.shape[k] != b.shape[k]]
                for i, x in enumerate(e.inputs):
                    dims = [d for d, s in enumerate(x.shape) if s == n]
                    if len(dims) != 1:
                        continue
                    for j, k in changed:
                        if sum(1 for jj, _ in changed if jj == j) == 1:
                            found.append((i, dims[0], j, k))
    except Exception:  # noqa: BLE001 - an op fakes cannot run tells us nothing
        found = []
    _CACHE[key] = found
    return [(e.inputs[i], d, e.outputs[j], k) for i, d, j, k in found]


def is_positionwise(e: Eqn, seq_dims: dict[int, int], out_dims: dict[int, int], n: int = 6, m: int = 4) -> bool:
    """Whether the op commutes with taking the first m positions along the sequence.

    seq_dims: input index -> its sequence dim; out_dims: output index -> its sequence dim.
    Other inputs keep their (global) shapes and random values."""
    key = ("pw", e.op.target, tuple((x.dtype, x.shape) for x in e.inputs), repr(e.args), repr(e.kwargs),
           tuple(sorted(seq_dims.items())), tuple(sorted(out_dims.items())))
    if key in _CACHE:
        return _CACHE[key]
    g = torch.Generator().manual_seed(0)

    def make(x: Var, i: int, length: int):
        shape = list(x.shape)
        if i in seq_dims:
            shape[seq_dims[i]] = length
        if x.dtype.is_floating_point or x.dtype.is_complex:
            return torch.randn(shape, generator=g, dtype=x.dtype if x.dtype.is_floating_point else torch.float32
                               ).to(x.dtype)
        if x.dtype == torch.bool:
            return torch.rand(shape, generator=g) < 0.5
        return torch.randint(0, max(2, min(x.shape) if x.shape else 2), shape, generator=g, dtype=x.dtype)

    try:
        full_in = [make(x, i, n) for i, x in enumerate(e.inputs)]
        full = _run(e, full_in)
        ok = True
        for start in (0, n - m):        # a prefix and a suffix: a causal scan passes the first alone
            part_in = [t.narrow(seq_dims[i], start, m).contiguous() if i in seq_dims else t
                       for i, t in enumerate(full_in)]
            part = _run(e, part_in)
            for j, d in out_dims.items():
                a, b = full[j].narrow(d, start, m), part[j]
                same = a.shape == b.shape and (bool(torch.allclose(a, b, rtol=1e-6, atol=1e-6, equal_nan=True))
                                               if a.is_floating_point() else bool(torch.equal(a, b)))
                ok = ok and same
    except Exception:  # noqa: BLE001 - cannot run on small inputs: not shown position-wise
        ok = False
    _CACHE[key] = ok
    return ok
