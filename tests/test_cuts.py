"""Per-layer checkpointing found in the dataflow (autosp/remat/cuts.py): a Llama's cuts are its layer and
half-layer boundaries, the plans that keep what crosses them are feasible programs that recompute the rest,
and where one is the least peak the planner finds, the step runs it exactly, priced to the measurement."""
import numpy as np
import torch

import autosp
from autosp.run.meshes import fake_world, planning_mesh
from tests.dist import run_ranks
from tests.models import assert_close as _close, assert_peak, reference as _reference


def _local(layers: int, s: int, sp: int = 2):
    from tests.models import llama_loss, tiny_llama
    model = tiny_llama(layers=layers, hidden=128, heads=8, kv_heads=4, vocab=512, device="meta")
    params = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
    ids = torch.zeros(1, s, dtype=torch.long, device="meta")
    return autosp.shard(llama_loss(model), planning_mesh(sp)).graphs(params, ids, ids)[1]


def _problem(joint):
    from autosp.remat.cost import device_for
    from autosp.remat.problem import build
    return build(joint, device_for("cpu"))


def test_the_cuts_of_a_llama_are_its_layer_and_half_layer_boundaries():
    from autosp.remat import joint_of
    from autosp.remat.cuts import activations, cuts
    for layers in (2, 4):
        with fake_world(2):
            joint = joint_of(_local(layers, 512))[1]
        p, needs = _problem(joint)
        fwd = joint.forward_eqns
        found = cuts(p, needs, activations(joint))
        ops = [fwd[p.eqns[p.value_eqn[max(c, key=lambda i: p.value_bytes[i])]]].op.name for c in found]
        # the embedding, two residual adds per layer (attention, MLP), then the final norm before the head
        assert ops[0] == "embedding" and ops[1:1 + 2 * layers] == ["add.Tensor"] * (2 * layers), ops
        assert all(op == "mul.Tensor" for op in ops[1 + 2 * layers:]), ops
        # only the residual stream crosses: the rotary tables and the parameters' casts are not activations
        assert all(len(c) == 1 for c in found), found


def test_a_checkpoint_plan_keeps_what_crosses_and_recomputes_the_rest():
    from autosp.remat import joint_of
    from autosp.remat.cuts import activations, checkpoint_plan, checkpoint_plans, cuts
    from autosp.remat.plan import _program, simulate_step
    with fake_world(2):
        joint = joint_of(_local(4, 1024))[1]
    p, needs = _problem(joint)
    nK, nV = len(p.eqns), len(p.values)
    found = cuts(p, needs, activations(joint))
    every = {i for c in found for i in c}
    x = checkpoint_plan(p, needs, every)
    assert p.feasible(x)
    saved = set(np.flatnonzero(x[nK:nK + nV] > 0.5).tolist())
    # what is saved: the values crossing the cuts that the backward needs, and what cannot be recomputed
    assert saved - every <= {i for i in range(nV) if np.isinf(p.cost[p.value_eqn[i]])}, saved - every
    assert len(saved & every) >= 8
    assert not np.any(x[nK + nV:])                          # offloading was not allowed
    plans = checkpoint_plans(p, needs, activations(joint))
    assert len(plans) >= 3 and any(np.array_equal(x, y) for _, y in plans)
    assert all(how.startswith("per-layer checkpointing: what crosses every") for how, _ in plans), plans
    peaks = [simulate_step(_program(joint, p, y), "cpu").peak for _, y in plans]
    no_remat = simulate_step(_program(joint, p, np.concatenate([np.zeros(nK), np.ones(nV), np.zeros(nV)])), "cpu")
    assert max(peaks) < no_remat.peak, (peaks, no_remat.peak)
    # with a host capacity, the earliest checkpoints go to the host, as many as fit
    from autosp.remat.cost import device_for
    from autosp.remat.problem import build, host_limit
    q, needs_q = build(joint, device_for("cpu", 1e10), offload=True)
    cap = 3.5 * float(max(p.value_bytes[i] for i in every))
    y = checkpoint_plan(host_limit(q, cap), needs_q, every, host=cap)
    moved = np.flatnonzero(y[nK + nV:] > 0.5)
    assert 1 <= len(moved) <= 3 and q.value_bytes[moved].sum() <= cap
    assert max(q.value_eqn[moved]) < min(q.value_eqn[i] for i in np.flatnonzero(y[nK:nK + nV] > 0.5) if i in every)


def _least_job(rank, world):
    """The least-peak plan of a 4-layer Llama (s = 1024, SP = 2): per-layer checkpointing wins it; the step
    runs it exactly and the profiler measures the plan's peak."""
    from torch.distributed.device_mesh import init_device_mesh
    from autosp.memory import peak_bytes
    from autosp.passes.tile import find_chains, tile
    from autosp.remat import joint_of, tiling_levels
    from autosp.remat.cuts import activations, checkpoint_plans
    from autosp.remat.plan import _program, simulate_step
    from tests.models import batch, llama_loss, params_of, tiny_llama
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    torch.manual_seed(0)
    model = tiny_llama(layers=4, hidden=64, heads=4, kv_heads=2, vocab=128)
    fn, params = llama_loss(model), params_of(model)
    ids, labels = batch(1, 1024, 128, pad=5)
    ref_loss, ref_grads = _reference(fn, params, ids, labels)
    vg = autosp.value_and_grad(fn, mesh, memory_budget="least")
    loss, grads = vg(params, ids, labels)
    _close(loss, ref_loss, "least loss")
    for k in params:
        _close(grads[k], ref_grads[k], f"least grad {k}")
    measured, _ = peak_bytes(lambda: vg(params, ids, labels))
    plan = vg.sharded.plan(autosp.api._differentiable(params), ids, labels)
    local = vg.sharded.graphs(autosp.api._differentiable(params), ids, labels)[1]
    chains = find_chains(local)
    seeds = []
    for ks in (tiling_levels(chains)[0], tiling_levels(chains)[-1]):
        joint = joint_of(tile(local, ks, chains) if ks else local)[1]
        p, needs = _problem(joint)
        seeds += [simulate_step(_program(joint, p, x), "cpu").peak
                  for _, x in checkpoint_plans(p, needs, activations(joint))]
    return plan.peak_bytes, measured, min(seeds), str(plan)


def test_per_layer_checkpointing_is_the_least_peak_and_runs_exactly():
    for rank, (predicted, measured, seed, text) in enumerate(run_ranks(_least_job, 2)):
        assert predicted == seed and "found by per-layer checkpointing" in text, (rank, predicted, seed, text)
        assert_peak(predicted, measured, atol=512, rtol=1e-4, what=f"per-layer checkpointing, rank {rank}")
