"""Host offload at scale: pooled host buffers reused across steps, a host memory capacity the plan
holds to, and the step still exact under it (CPU path: `host_bandwidth=` turns offload on)."""
import pytest
import torch

import autosp
from tests.dist import run_ranks
from tests.models import assert_close, reference
from tests.test_remat import _model, _small_problem, _stack_problem

HOST_BW = 1e13          # a host link so fast that offloading is the cheapest way to fit


def test_the_host_pool_reuses_storage_across_steps_and_never_aliases_a_live_copy():
    from autosp.remat.offload import _HostPool, offload, prefetch
    pool = _HostPool()
    x = torch.randn(8, 4).t()                                # (4, 8), not contiguous: a clone's strides
    a = pool.copy(x)
    b = pool.copy(2 * x)                                     # a is alive: another buffer
    assert a.stride() == x.clone().stride() and torch.equal(a, x)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    ptr_a = a.untyped_storage().data_ptr()
    del a
    c = pool.copy(3 * x)                                     # a is dead: its buffer again
    assert c.untyped_storage().data_ptr() == ptr_a and torch.equal(c, 3 * x) and torch.equal(b, 2 * x)
    assert pool.nbytes() == 2 * x.nbytes and not pool.pin

    # the op, step after step: the same storage each step, the copy back exact
    from autosp.remat import offload as O
    ptrs = []
    for step in range(3):
        h = offload(x + step)
        ptrs.append(h.untyped_storage().data_ptr())
        assert torch.equal(prefetch(h, "cpu"), x + step)
        del h
    assert len(set(ptrs)) == 1, ptrs
    held = O._host_pool.nbytes()
    for _ in range(2):
        offload(x)
    assert O._host_pool.nbytes() == held                    # no buffer grows the pool once a step has run


def _plans(host_memory, budget=0.6, offload=True):
    from autosp.remat.cost import device_for
    from autosp.remat.plan import make_plan
    joint, _, _ = _stack_problem(4, length=64)
    return make_plan(joint, budget, device_for("cpu", HOST_BW), offload=offload, host_memory=host_memory)[0]


def test_a_host_capacity_caps_what_the_plan_offloads():
    free = _plans(None)
    assert free.offload_bytes > 0 and free.host_memory_bytes is None
    cap = free.offload_bytes // 2
    held = _plans(cap)
    assert 0 < held.offload_bytes <= cap and held.peak_bytes <= held.budget_bytes, held
    assert held.host_memory_bytes == cap and "host memory" in str(held) and "host transfers" in str(held)
    # the transfers' time: out and back over the host link, per offloaded value
    assert held.offload_seconds == pytest.approx(2 * held.offload_bytes / HOST_BW)
    assert _plans(f"{cap}B").offload_bytes <= cap              # a size string, as memory_budget takes
    none, off = _plans(0), _plans(None, offload=False)          # no room: the no-offload plan
    assert none.offload_bytes == 0 and none.offload_seconds == 0
    assert [(d.name, d.action) for d in none.decisions] == [(d.name, d.action) for d in off.decisions]


def test_host_memory_errors_name_it_and_the_fix():
    from autosp.remat.cost import device_for
    from autosp.remat.plan import make_plan, parse_host_memory
    assert parse_host_memory("64GiB") == 64 * 2**30 and parse_host_memory(None) is None
    assert parse_host_memory(0) == 0 and parse_host_memory(1e9) == 10**9
    for bad in ("lots", -1, True, [1], 0.5, "least"):
        with pytest.raises(autosp.AutospError, match=r"host_memory=.*Fix:"):
            parse_host_memory(bad)
    # a budget that offloading meets, refused for want of host memory: the message says so
    joint, _, _ = _small_problem()
    dev = device_for("cpu", HOST_BW)
    least_off = make_plan(joint, "least", dev, offload=True)[0].peak_bytes
    least_on_device = make_plan(joint, "least", dev, offload=False)[0].peak_bytes
    assert least_off < least_on_device
    with pytest.raises(autosp.remat.BudgetError) as info:
        make_plan(joint, (least_off + least_on_device) // 2, dev, offload=True, host_memory=0)
    msg = str(info.value)
    assert "within host_memory=0 bytes per rank" in msg and "Host memory runs out" in msg, msg
    assert "Fix: host_memory=" in msg and info.value.least_peak_bytes >= least_on_device * 0.99, msg


def _limited_job(rank, world):
    """The multi-rank step under half the host memory the unconstrained plan offloads: still exact, two
    steps in a row (the second reuses the first's host buffers), and a third with the copies deferred."""
    from torch.distributed.device_mesh import init_device_mesh
    from autosp.remat import offload as O
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    model, fn, params, args = _model(s=64, layers=2)
    ref_loss, ref_grads = reference(fn, params, *args)
    free = autosp.plan(fn, mesh, params, *args, memory_budget=0.6, host_bandwidth=HOST_BW)
    cap = free.offload_bytes // 2
    vg = autosp.value_and_grad(fn, mesh, memory_budget=0.6, host_bandwidth=HOST_BW, host_memory=cap)
    held = []
    for step in range(2):
        loss, grads = vg(params, *args)
        assert_close(loss, ref_loss, f"step {step} loss under host_memory={cap}")
        for k in params:
            assert_close(grads[k], ref_grads[k], f"step {step} grad {k} under host_memory={cap}")
        held.append(O._host_pool.nbytes())
    with O.deferred():            # the copies as late as a GPU's side stream may make them: still exact
        loss, grads = vg(params, *args)
    assert_close(loss, ref_loss, "deferred copies: loss")
    for k in params:
        assert_close(grads[k], ref_grads[k], f"deferred copies: grad {k}")
    plan = vg.sharded.plan(autosp.api._differentiable(params), *args)
    return free.offload_bytes, cap, plan.offload_bytes, held


def test_a_host_limited_plan_runs_exactly_on_two_ranks():
    for rank, (free, cap, offloaded, held) in enumerate(run_ranks(_limited_job, 2)):
        assert free > 0 and 0 < offloaded <= cap, (rank, free, cap, offloaded)
        assert held[0] == held[1], (rank, held)


def test_the_saved_bytes_followed_through_a_step_count_offloaded_values_on_the_device_only():
    # autosp plan splits a row's peak into what the forward saved for the backward and the working set: an
    # offloaded value counts while it is on the device, before it leaves and once it is fetched back
    from autosp.remat import simulate_step
    from autosp.remat.cost import device_for
    from autosp.remat.liveness import nbytes
    from autosp.remat.plan import make_plan
    joint, _, _ = _stack_problem(4, length=64)
    _, program = make_plan(joint, 0.6, device_for("cpu", HOST_BW), offload=True)
    assert program.offloaded
    mem = simulate_step(program, "cpu", saved=True)
    f, b = mem.forward, mem.backward
    assert len(f.tracked) == len(f.during) + 2 and len(b.tracked) == len(b.during) + 2
    fwd = {o.name: o for e in program.forward.eqns for o in e.outputs}
    # the forward ends holding what it keeps on the device; the backward starts without the host copies
    kept = sum(nbytes(fwd[n]) for n in program.saved if n in fwd)
    assert f.tracked[-1] == kept
    assert b.tracked[0] == sum(nbytes(v) for v in program.backward.inputs if v.name in set(program.saved))
    # during each backward equation: the storages of the saved inputs and of the values fetched back, from
    # their start (or fetch) to the last read of any view of them
    from autosp.ir.aliases import roots
    from autosp.remat.liveness import last_uses
    g = program.backward
    last, root, names = last_uses(g), roots(g), set(program.saved) | set(program.offloaded)
    span = {v.name: (-1, last.get(v.name, -1)) for v in g.inputs}
    span.update({o.name: (i, last.get(o.name, i)) for i, e in enumerate(g.eqns) for o in e.outputs})
    base = {v.name: v for v in g.inputs} | {o.name: o for e in g.eqns for o in e.outputs}
    followed = {root[n] for n in names if n in root}
    assert sum(e.op.name == "prefetch" and e.outputs[0].name in names for e in g.eqns) == len(program.offloaded)
    for i, e in enumerate(g.eqns):
        live = {root[n] for n, (a, z) in span.items() if a <= i <= z and root[n] in followed}
        assert b.tracked[i + 1] == sum(nbytes(base[r]) for r in live), (i, e.format())
