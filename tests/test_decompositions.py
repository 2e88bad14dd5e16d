"""Decompositions applied while tracing: grouped_mm (transformers' default MoE experts kernel).

torch's fake kernel for `aten._grouped_mm` accepts bf16 only; the CPU kernel runs fp32. autosp maps
the (M, K) x (G, K, N) form with offsets onto `autosp::grouped_mm` while tracing: it must equal
eager's grouped_mm, forward and backward, including empty groups, and trace in fp32.
"""
import pytest
import torch
import torch.nn.functional as F

import autosp
from autosp.decompositions import grouped_mm as decomposed, trace_decompositions
from autosp.ir import lower, verify

eager_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
pytestmark = pytest.mark.skipif(eager_grouped_mm is None, reason="this torch has no grouped_mm")

# group 0: rows 0-2, group 1: empty, group 2: rows 3-8, group 3: rows 9-11 (K and N multiples of 4:
# the CPU kernel wants 16-byte strides)
OFFS = [3, 3, 9, 12]


def _case(seed=0, m=12, k=8, n=12, offs=OFFS):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g, dtype=torch.float64).float()
    b = torch.randn(len(offs), k, n, generator=g, dtype=torch.float64).float()
    grad = torch.randn(m, n, generator=g, dtype=torch.float64).float()
    return a, b, torch.tensor(offs, dtype=torch.int32), grad


def _value_and_grads(fn, a, b, offs, grad):
    a, b = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    out = fn(a, b, offs)
    ga, gb = torch.autograd.grad(out, (a, b), grad)
    return out, ga, gb


def test_grouped_mm_decomposition_equals_eager_fp32_forward_and_backward():
    a, b, offs, grad = _case()
    want = _value_and_grads(lambda x, w, o: eager_grouped_mm(x, w, offs=o), a, b, offs, grad)
    got = _value_and_grads(decomposed, a, b, offs, grad)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert got[2][1].abs().max() == 0            # the empty group's weight gets no gradient
    # against float64 by hand: row i times its group's matrix
    ref = torch.cat([a[s:e].double() @ b[i].double() for i, (s, e) in enumerate(zip([0] + OFFS[:-1], OFFS))])
    torch.testing.assert_close(got[0].double(), ref, rtol=1e-5, atol=1e-5)


def test_grouped_mm_batched_form_is_bmm():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 5, 4, generator=g), torch.randn(3, 4, 8, generator=g)
    torch.testing.assert_close(decomposed(a, b), torch.bmm(a, b))
    assert decomposed(a[0], b[0].t().contiguous(), torch.tensor([2], dtype=torch.int32)) is NotImplemented


def test_grouped_mm_traces_in_fp32_and_runs_like_eager():
    """A user's fp32 grouped_mm traces (torch's own fake kernel refuses it) into one grouped_mm equation;
    the traced graph, interpreted and lowered, equals eager, and so do its grads."""
    assert trace_decompositions()
    a, b, offs, grad = _case(seed=2)

    def fn(x, w, o):
        return eager_grouped_mm(x, w, offs=o)

    graph = verify(autosp.trace(fn, a, b, offs))
    assert [e.op.name for e in graph.eqns] == ["grouped_mm"]
    want = _value_and_grads(fn, a, b, offs, grad)
    torch.testing.assert_close(graph(a, b, offs), want[0], rtol=1e-5, atol=1e-5)
    got = _value_and_grads(lambda x, w, o: lower(graph)(x, w, o)[0], a, b, offs, grad)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_grouped_mm_form_without_fp32_fake_kernel_error_names_the_forms():
    """The 2-D x 2-D form (offsets along K) is left to torch, whose fake kernel refuses fp32: the error
    names grouped_mm, the forms autosp rewrites, and the fix."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(8, 12, generator=g), torch.randn(12, 8, generator=g)
    offs = torch.tensor([4, 12], dtype=torch.int32)
    with pytest.raises(autosp.AutospError, match=r"(?s)grouped_mm.*\(M, K\) x \(G, K, N\).*batched_mm"):
        autosp.trace(lambda x, w, o: eager_grouped_mm(x, w, offs=o), a, b, offs)


def test_integer_histc_traces_on_meta_and_counts_as_the_float_histogram():
    """transformers counts tokens per expert with histc(ids.int()) off the CPU; a meta trace (autosp plan/train
    of a MoE config) reaches it, and the meta kernel takes floats only: traced as the float histogram, cast back."""
    from autosp.trace import trace

    def count(ids):
        return torch.histc(ids.int(), bins=4, min=0, max=3)
    graph = trace(count, torch.zeros(10, dtype=torch.long, device="meta"))
    ids = torch.tensor([0, 3, 3, 1, 2, 3, 0, 9, 1, 1])
    out = graph(ids)
    got = out[0] if isinstance(out, (tuple, list)) else out
    assert got.dtype == torch.int32 and got.tolist() == torch.histc(ids.float(), 4, 0, 3).int().tolist()
