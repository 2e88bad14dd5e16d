"""functionalize: in-place writes (on bases and through views) become values, same results."""
import pytest
import torch
import torch.nn.functional as F

import autosp
from autosp.passes.functionalize import functionalize


def _writes(x, w):
    y = F.linear(x, w)
    y += 1                          # a base
    t = y.transpose(1, 2)
    z = y.new_zeros(y.shape)
    z[..., :2] = y[..., :2]         # through a slice
    z[..., 2:].mul_(3)
    z[:, 1] = 5                     # through a select
    t.mul_(2)                       # through a transpose: y changes too
    q = z + y
    q.masked_fill_(q > 4, 0.5)
    r = q.mul_(0.5).add_(1)         # the results of in-place ops, read later (HF's cache: `detach_()`)
    n = y.sum().detach_()
    return (q * q).sum() + y.sum() + t.sum() + (r * n).sum()


def test_functionalize_keeps_values_and_removes_every_write():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 4, 8, generator=g), torch.randn(8, 8, generator=g)
    graph = autosp.trace(_writes, x, w)
    assert any(e.op.has(autosp.ir.Tag.INPLACE) for e in graph.eqns)
    fg = autosp.ir.verify(functionalize(graph))
    assert not any(e.op.has(autosp.ir.Tag.INPLACE) for e in fg.eqns)
    assert torch.equal(fg(x, w), _writes(x, w))
    assert "slice_scatter" in str(fg) and "select_scatter" in str(fg)


def test_functionalize_refuses_what_it_cannot_invert():
    def bad(x):
        y = x * 1
        y.unfold(0, 2, 1).mul_(2)      # an overlapping window: no scatter inverts it
        return y.sum()
    with pytest.raises(autosp.AutospError, match="cannot be rewritten functionally"):
        functionalize(autosp.trace(bad, torch.randn(6)))
