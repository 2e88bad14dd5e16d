"""The attention backward's kernel as a choice of the plan (passes/attention_backward.py): autosp::sdpa_backward in
place of SDPA's backend is exact, keeps the backend's layouts, and is chosen for a GPU where the backend's scratch
is what holds the peak up; never for the CPU, whose kernel's scratch is per thread."""
import pytest
import torch
import torch.nn.functional as F

import autosp
from autosp.ir.interpret import eval_graph
from autosp.passes.attention_backward import count, with_autosp_backward
from autosp.passes.autodiff import differentiate
from autosp.remat import liveness as L
from autosp.remat import plan_step


def _loss(layers=2, heads=8, kv=2):
    def loss(p, x):                                          # x: (b, s, d); HF's layout: heads split from d
        h = x
        for i in range(layers):
            b, s, d = h.shape
            q = (h @ p[f"q{i}"]).view(b, s, heads, -1).transpose(1, 2)           # (b, heads, s, dh)
            kv_ = (h @ p[f"k{i}"]).view(b, s, kv, -1).transpose(1, 2)            # (b, kv, s, dh)
            o = F.scaled_dot_product_attention(q, kv_, kv_ * 0.5, is_causal=True, enable_gqa=True)
            h = h + o.transpose(1, 2).reshape(b, s, d) @ p[f"o{i}"]
        return (h.float() ** 2).mean()
    return loss


def _params(d=64, layers=2, kv=2, heads=8, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: (torch.randn(*s, generator=g) / s[0] ** 0.5).to(device=device, dtype=dtype).requires_grad_()
    p = {}
    for i in range(layers):
        p.update({f"q{i}": mk(d, d), f"k{i}": mk(d, d * kv // heads), f"o{i}": mk(d, d)})
    return p


@pytest.mark.parametrize("s", [127, 256])
def test_autosp_backward_in_place_of_sdpas_is_exact_and_keeps_the_layouts(s):
    params, x = _params(), torch.randn(2, s, 64, generator=torch.Generator().manual_seed(1))
    joint = differentiate(autosp.trace(_loss(), params, x))
    ours = with_autosp_backward(joint)
    assert count(joint) == 2 and count(ours) == 0
    assert sum(e.op.name == "sdpa_backward" for e in ours.backward_eqns) == 2
    assert ours.forward_eqns == joint.forward_eqns                   # the forward as it was
    ins = [p for p in params.values()] + [x] + [torch.ones(())]
    want = eval_graph(joint.graph, *ins)
    got = eval_graph(ours.graph, *ins)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _least(device, attention=None, s=4096):
    params = _params(d=1024, heads=16, kv=4, device="meta", dtype=torch.bfloat16)
    x = torch.empty(1, s, 1024, device="meta", dtype=torch.bfloat16)
    graph = autosp.trace(_loss(heads=16, kv=4), params, x)
    return plan_step(graph, "least", device=device, attention=attention)


def test_a_gpu_plan_takes_autosps_kernel_where_the_backends_scratch_holds_the_peak():
    """Planned on meta for a GPU (cuDNN's backward: fp32 dQ and dK/dV at every query head), the least peak is at an
    attention backward; autosp's kernel lowers it, so the least-peak plan takes it, and says so."""
    backend = _least("h100", "sdpa")[0]
    ours = _least("h100", "autosp")[0]
    auto, program, _, _ = _least("h100")
    assert ours.peak_bytes < backend.peak_bytes
    assert auto.attention_backward == "autosp" and auto.peak_bytes == ours.peak_bytes
    assert "autosp's kernel" in str(auto)
    kinds = {L.attention_backward_kernel(e, "h100") for e in program.backward.eqns} - {None}
    assert kinds == {"autosp"}


def test_the_cpu_plans_with_its_own_kernel():
    plan = _least("cpu", s=512)[0]
    assert plan.attention_backward == "sdpa"


def test_a_refused_gpu_verdict_takes_autosps_kernel_from_its_helper(monkeypatch):
    """A verdict on a GPU searches autosp's kernel after the backend's; with a core idle (remat/helper.py) a helper
    searches it beside the backend's end. Refused here (a byte under the least), the least is the helper's plan,
    whose programs the search derives: the same plan, decisions and peak as searched in one process."""
    from autosp.remat import simulate_step
    from autosp.remat.helper import Helper, idle_core
    monkeypatch.setenv("AUTOSP_PLAN_CACHE", "off")
    params = _params(d=1024, heads=16, kv=4, device="meta", dtype=torch.bfloat16)
    x = torch.empty(1, 4096, 1024, device="meta", dtype=torch.bfloat16)
    graph = autosp.trace(_loss(heads=16, kv=4), params, x)
    least = plan_step(graph, "least", device="h100", refine=False, plan_only=True)[0]
    budget = least.peak_bytes + least.const_bytes - 1
    alone = plan_step(graph, "least", device="h100", refine=False, plan_only=True, enough=budget)[0]
    took, take = [], Helper.take
    monkeypatch.setattr(Helper, "take", lambda self: took.append(take(self)) or took[-1])
    with idle_core():
        plan, program, _, _ = plan_step(graph, "least", device="h100", refine=False, plan_only=True, enough=budget)
    assert len(took) == 1 and took[0] is not None and took[0][0].attention_backward == "autosp"
    assert plan.attention_backward == alone.attention_backward == "autosp"
    assert (plan.peak_bytes, plan.decisions, plan.method) == (alone.peak_bytes, alone.decisions, alone.method)
    assert int(simulate_step(program, "h100").peak) == plan.peak_bytes
