"""The IR: trace, print, verify, interpret and lower equal eager, forward and grad_and_value."""
import pytest
import torch
from torch.utils import _pytree as pytree

import autosp
from autosp.ir import Role, lower, verify
from tests.models import MLP, GPT, batch, gpt_loss, llama_loss, params_of, tiny_llama


def _flat(graph, *args):
    return autosp.ir.interpret.flatten_inputs(graph, args)


def _check(fn, *args, rtol_loss=1e-6, rtol_grad=1e-5):
    """trace(fn) interpreted and lowered equal fn eagerly."""
    want = fn(*args)
    graph = verify(autosp.trace(fn, *args))
    got = graph(*args)
    lowered = pytree.tree_unflatten(list(lower(graph)(*_flat(graph, *args))), graph.out_spec)
    for out in (got, lowered):
        w_leaves, w_spec = pytree.tree_flatten(want)
        g_leaves, g_spec = pytree.tree_flatten(out)
        assert w_spec == g_spec
        for w, g in zip(w_leaves, g_leaves):
            tol = rtol_loss if w.ndim == 0 else rtol_grad
            torch.testing.assert_close(g, w, rtol=tol, atol=tol * max(1.0, w.abs().max().item()) * 1e-2)
    return graph


def test_mlp_forward_and_grad():
    model = MLP()
    params = params_of(model)
    x = torch.randn(4, 16)

    def loss(params, x):
        return torch.func.functional_call(model, params, (x,)).pow(2).mean()

    g = _check(loss, params, x)
    assert any(e.op.name == "linear" for e in g.eqns)
    _check(torch.func.grad_and_value(loss), params, x)


def test_gpt_forward_and_grad():
    model = GPT()
    params = params_of(model)
    ids, _ = batch(2, 24, 64)
    fn = gpt_loss(model)
    g = _check(fn, params, ids)
    names = {e.op.name for e in g.eqns}
    assert {"attention", "arange", "embedding", "slice", "cross_entropy"} <= names
    _check(torch.func.grad_and_value(fn), params, ids)


def test_llama_gqa_forward_and_grad():
    model = tiny_llama()
    params = params_of(model)
    ids, labels = batch(2, 16, 64, pad=3)
    fn = llama_loss(model)
    g = _check(fn, params, ids, labels)
    att = [e for e in g.eqns if e.op.name == "attention"]
    assert len(att) == 2 and dict(att[0].kwargs).get("enable_gqa") is True
    # RoPE's inv_freq is a buffer the user never passes: it is a constant, not an input
    assert g.consts and all(v.role is Role.CONST for v, _ in g.consts)
    _check(torch.func.grad_and_value(fn), params, ids, labels)


def test_printed_ir_one_line_per_equation():
    model = MLP()
    g = autosp.trace(lambda p, x: torch.func.functional_call(model, p, (x,)), params_of(model), torch.randn(4, 16))
    text = str(g)
    body = [l for l in text.splitlines() if " = " in l and "const" not in l]
    assert len(body) == len(g.eqns)
    assert "f32[4,32] = linear(%x, %p.up.weight, %p.up.bias)" in text


def test_inputs_roles_and_static_args():
    w = torch.randn(3, 3, requires_grad=True)
    g = autosp.trace(lambda w, x, k: (w @ x) * k, w, torch.randn(3, 2), 2.0)
    assert [v.role for v in g.inputs] == [Role.PARAM, Role.INPUT]
    assert g.static_args == ((2, 2.0),)
    torch.testing.assert_close(g(w, torch.ones(3, 2), 2.0), (w @ torch.ones(3, 2)) * 2)


def test_meta_llama_traces_without_memory():
    """Two layers of the 8B shape at s=32768 on the meta device: nothing is allocated."""
    model = tiny_llama(layers=2, vocab=128256, hidden=4096, heads=32, kv_heads=8, device="meta",
                       intermediate_size=14336)
    params = dict(model.named_parameters())
    ids = torch.zeros(1, 32768, dtype=torch.long, device="meta")
    g = verify(autosp.trace(llama_loss(model), params, ids, ids))
    assert g.eqns[-1].outputs[0].shape == ()
    assert sum(e.op.name == "attention" for e in g.eqns) == 2


def test_verify_reports_bad_equation():
    model = MLP()
    g = autosp.trace(lambda p, x: torch.func.functional_call(model, p, (x,)), params_of(model), torch.randn(4, 16))
    bad = g.eqns[0].outputs[0]
    wrong = bad.__class__(bad.name, bad.dtype, (5, 5), bad.device)
    eqns = (g.eqns[0].replace(outputs=(wrong,)),) + g.eqns[1:]
    with pytest.raises(autosp.AutospError, match=r"declared f32\[5,5\].*op gives") as err:
        verify(g.replace(eqns=eqns))
    assert "> " in str(err.value)          # the bad line is marked in context
    dup = (g.eqns[0],) + g.eqns
    with pytest.raises(autosp.AutospError, match="defined twice"):
        verify(g.replace(eqns=dup), shapes=False)


def test_trace_errors_name_the_line_and_fix():
    def branchy(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(autosp.AutospError, match=r"(?s)test_ir.py:\d+: if x.sum\(\) > 0.*Fix") as err:
        autosp.trace(branchy, torch.randn(3))
    assert "torch.where" in str(err.value)

    def item(x):
        return x * x.max().item()

    with pytest.raises(autosp.AutospError, match=r"item"):
        autosp.trace(item, torch.randn(3))

    def selected(x):                        # a size the values decide: nonzero, boolean indexing
        return x[torch.nonzero(x > 0)[:, 0]].sum() + x[x < 0].sum()

    with pytest.raises(autosp.AutospError, match=r"(?s)aten.nonzero.*test_ir.py:\d+ in selected.*\['u0', '1'\].*Fix"):
        autosp.trace(selected, torch.randn(3))

    with pytest.raises(autosp.AutospError, match=r"object.*pytrees"):
        autosp.trace(lambda x, o: x, torch.randn(3), object())


def test_a_trace_without_source_lines_is_the_same_program():
    # autosp plan traces without make_fx's stack traces (a sixth of a large model's trace) and retraces
    # with them only to raise an error that names the line
    import sys
    from autosp.trace import without_sources
    trace = sys.modules["autosp.trace"].trace
    model = tiny_llama()
    fn, params, (ids, labels) = llama_loss(model), params_of(model), batch(2, 32, 64)
    full = trace(fn, params, ids, labels)
    with without_sources():
        bare = trace(fn, params, ids, labels)
    assert str(full) == str(bare)
    assert any(e.source for e in full.eqns) and not any(e.source for e in bare.eqns)
    assert any(e.source for e in trace(fn, params, ids, labels).eqns)       # back on after the block
