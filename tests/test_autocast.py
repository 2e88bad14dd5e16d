"""torch.autocast in the code autosp shards: the casts autocast makes are the program's own (trace.explicit_autocast).

make_fx(pre_dispatch=True) records an autocast region as two markers around ops that read their inputs' own
dtypes (`linear` of fp32 tensors with a bf16 result); the sharding pass failed on the markers (an AttributeError,
not an AutospError), and a program run as recorded would compute in fp32. Now the traced program, run on one device,
is eager autocast to the bit (the loss and every gradient, RoPE's nested enabled=False region included), whether
the region is in the function or around the call; that is what holds the casts to autocast's.

Sharded (sp 2 with the region in the function, around the call and at the least budget; sp 4 and dp 2 x sp 2), every
linear of each rank's program computes in bf16 (and at the least budget the plan is not under the measured peak,
over it by bf16 CPU attention's scratch envelope: 7.5 KB of 390 KB), the loss is within 1e-5 of one device's, and
every gradient within bf16's resolution, 2^-6 of its largest entry: a bf16 matmul's gradient over the tokens is each
rank's bf16 product of its share, summed in fp32, where one device rounds one product (measured 4.9e-3 at sp 2,
where the rest, computed in fp32, are within 5.5e-6), and that rounding reaches every gradient behind it (7.3e-3 at
sp 4, with 4 or 2 KV heads alike). The same step run in fp32 differs from autocast's by 9.8e-3: the bound does not
tell the two apart, the bit-exact trace above does.
"""
import torch

from tests.dist import run_ranks
from tests.models import assert_every_rank

BF16 = 2.0 ** -6


def _model():
    from tests.models import tiny_llama
    torch.manual_seed(0)
    return tiny_llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128)


def _in_region(model):
    def loss_fn(params, input_ids, labels):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.func.functional_call(model, params, (input_ids,), {"labels": labels}).loss
    return loss_fn


def test_the_traced_program_is_eager_autocast_to_the_bit():
    from autosp.ir.lower import lower
    from autosp.trace import no_autocast, trace
    from tests.models import batch, llama_loss, params_of, reference
    model = _model()
    params = params_of(model)
    ids, labels = batch(1, 64, 128, pad=3)
    fn = _in_region(model)
    ref_loss, ref_grads = reference(fn, params, ids, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ambient = trace(llama_loss(model), params, ids, labels)      # the caller's region, not the function's
    for name, graph in (("in the function", trace(fn, params, ids, labels)), ("around the call", ambient)):
        ops = [e.op.name for e in graph.eqns]
        assert not any("autocast" in op for op in ops), (name, ops)
        assert any(e.op.name == "linear" and e.outputs[0].dtype == torch.bfloat16 for e in graph.eqns), name
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        with no_autocast():
            loss = lower(graph)(*p.values(), ids, labels)[0]
            grads = torch.autograd.grad(loss, list(p.values()))
        assert torch.equal(loss, ref_loss), (name, loss, ref_loss)
        for k, g in zip(p, grads):
            assert torch.equal(g, ref_grads[k]), (name, k, (g - ref_grads[k]).abs().max())


def _job(rank, world, shape, cases):
    import autosp
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import batch, llama_loss, params_of, rank_errors, reference
    names = ("dp", "sp") if len(shape) == 2 else ("sp",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_rank = mesh.get_local_rank("dp") if len(shape) == 2 else 0
    model = _model()
    params = params_of(model)
    fn = _in_region(model)
    batches = [batch(1, 61, 128, seed=seed, pad=3) for seed in range(shape[0] if len(shape) == 2 else 1)]
    refs = [reference(fn, params, *b) for b in batches]             # each dp rank its own batch: the mean of both
    ref_loss = sum(r[0] for r in refs) / len(refs)
    ref_grads = {k: sum(r[1][k] for r in refs) / len(refs) for k in params}
    errors = {}
    for case, budget in cases:
        vg = autosp.value_and_grad(llama_loss(model) if case == "around the call" else fn, mesh,
                                   memory_budget=budget)
        if case == "around the call":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, grads = vg(params, *batches[dp_rank])
        else:
            loss, grads = vg(params, *batches[dp_rank])
        errs = rank_errors(loss, grads, ref_loss, ref_grads)
        errors[case] = {"loss": errs.pop("loss")}
        errors[case + ", gradients in bf16's resolution"] = {k: v * 1e-5 / BF16 for k, v in errs.items()}
        if budget is not None:
            # the plan counts the casts; its one envelope is bf16 CPU attention's backward (oneDNN's scratch per
            # GEMM call and thread: liveness._cpu_flash_backward, never under, over by up to ~100 KiB at 2-4
            # threads): never under the measured peak by more than 512 B, never over by more than 100 KiB
            from autosp.memory import peak_bytes
            measured, _ = peak_bytes(lambda: vg(params, *batches[dp_rank]))
            plan = vg.sharded.plan(autosp.api._differentiable(params), *batches[dp_rank])
            over = plan.peak_bytes - measured
            errors[case + ", plan over the measured peak"] = {f"{over:+,} B": 0.0 if -512 <= over <= 100 << 10 else 1.0}
        (local, *_), = vg.sharded._cache.values()
        errors[case + ", linears not in bf16"] = {"count": sum(e.op.name == "linear" and e.outputs[0].dtype !=
                                                               torch.bfloat16 for e in local.eqns)}
    return errors


def test_autocast_shards_at_sp_2_and_4_and_dp2_by_sp2():
    every = (("in the function", None), ("around the call", None), ("least budget", "least"))
    for world, shape, cases in ((2, (2,), every), (4, (4,), every[:1]), (4, (2, 2), every[:1])):
        reports = run_ranks(_job, world, shape, cases)
        worst = max(e for r in reports for c, errs in r.items() if "resolution" in c for e in errs.values())
        print(f"mesh {shape}: the worst gradient {worst * BF16 / 1e-5:.2e} of its largest entry")
        assert_every_rank(reports)          # the gradients' errors scaled so that 2^-6 reads as 1e-5


def test_an_op_that_cannot_be_run_again_is_a_trace_error_naming_the_line(monkeypatch):
    """Each op of a region is run again on its fake inputs to see autocast's casts; if that fails, the error names
    the op, the line and the fix (a cast by hand), not torch's message alone."""
    import sys

    import pytest

    from autosp.errors import TraceError
    from tests.models import batch, params_of

    def refuse(regions):
        raise RuntimeError("no fake kernel here")
    trace_mod = sys.modules["autosp.trace"]             # the package's `trace` attribute is the function
    monkeypatch.setattr(trace_mod, "_autocast_contexts", refuse)
    model = _model()
    with pytest.raises(TraceError, match=r"autosp.trace: `aten\.\w+\.\w+` at .*\.py:\d+ .* inside torch.autocast could not "
                                         r"be run again to see autocast's casts \(no fake kernel here\)\. Fix: run that "
                                         r"op in an autocast\(enabled=False\) block"):
        trace_mod.trace(_in_region(model), params_of(model), *batch(1, 16, 128))


def test_autocast_over_meta_tensors_is_refused_naming_the_fix():
    """Autocast casts no meta tensor: a program traced on the meta device inside a region (how a plan for a device
    one does not have is made) would price fp32 compute. Refused, naming the fix; a region with enabled=False (as
    transformers' RoPE opens one) is not."""
    import pytest

    from autosp.errors import TraceError
    from autosp.trace import trace

    def loss(w, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.linear(x, w).float().sum()

    def kept_fp32(w, x):
        with torch.autocast("cpu", enabled=False):
            return torch.nn.functional.linear(x, w).sum()

    w, x = torch.randn(4, 3, device="meta"), torch.randn(2, 3, device="meta")
    with pytest.raises(TraceError, match=r"`aten.linear.default` at .*test_autocast.py:\d+ .*runs inside torch.autocast "
                                         r"\(cpu\) on meta tensors, which autocast does not cast.*Fix: trace with "
                                         r"tensors of the device autocast names"):
        trace(loss, w, x)
    assert [e.op.name for e in trace(kept_fp32, w, x).eqns] == ["linear", "sum"]
