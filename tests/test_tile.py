"""Sequence tiling of position-wise chains (passes/tile.py): found, rewritten Graph -> Graph, exact, and
chosen by the planner only when the budget needs it, with the measured peak below one whole wide value."""
import pytest
import torch

import autosp
from autosp.ir.verify import verify
from autosp.passes.tile import find_chains, tile, tile_sizes
from tests.dist import run_ranks
from tests.models import assert_close, assert_peak, batch, llama_loss, params_of, reference, tiny_llama


def _local(s=254, layers=2, vocab=128, hidden=64, b=1, sp=2):
    from autosp.run.meshes import planning_mesh
    torch.manual_seed(0)
    model = tiny_llama(layers=layers, hidden=hidden, heads=4, kv_heads=2, vocab=vocab)
    ids, labels = batch(b, s, vocab, pad=5)
    return autosp.shard(llama_loss(model), planning_mesh(sp, 1)).graphs(params_of(model), ids, labels)[1]


def test_the_mlp_and_loss_chains_are_found_and_tiled_graph_to_graph():
    from autosp.run.meshes import fake_world
    with fake_world(2):
        _found_and_tiled(_local())


def _found_and_tiled(local):
    chains = find_chains(local)
    assert [c.name for c in chains] == ["mlp.0", "mlp.1", "loss"]
    ops = {c.name: [local.eqns[i].op.name for i in c.eqns] for c in chains}
    assert ops["mlp.0"] == ["linear", "silu.default", "linear", "mul.Tensor", "linear"]
    assert ops["loss"] == ["linear", "to.dtype", "reshape", "cross_entropy"]       # the logits, per token
    loss = chains[-1]
    assert loss.length == 127 and len(loss.inputs) == 2 and loss.wide_bytes == 127 * 128 * 4
    tiled = verify(tile(local, {c.id: 3 for c in chains}))
    text = str(tiled)
    assert text.startswith("# tile") and text.count("split_with_sizes") == 4
    assert sum("= cat([%" in ln and ".t0" in ln for ln in text.splitlines()) == 3
    assert "f32[43,128] = reshape(" in text and "[43, 42, 42]" in text               # 127 = 43 + 42 + 42
    assert tile(local, {}) is local
    assert tile_sizes(300, 8) == [38, 38, 38, 38, 37, 37, 37, 37] and tile_sizes(3, 8) == [1, 1, 1]


def _tiled_job(rank, world, s, b, vocab, inter, tiles):
    """(loss, grads, single-device loss, grads) of the step with the chains tiled as `tiles` says."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    torch.manual_seed(0)
    model = tiny_llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=vocab, intermediate_size=inter)
    fn, params = llama_loss(model), params_of(model)
    ids, labels = batch(b, s, vocab, pad=5)
    vg = autosp.value_and_grad(fn, mesh, memory_budget=1.0, tiles=tiles)
    loss, grads = vg(params, ids, labels)
    plan = vg.sharded.plan(autosp.api._differentiable(params), ids, labels)
    return loss, grads, *reference(fn, params, ids, labels), plan.tiling


@pytest.mark.parametrize("world,s,b,tiles", [(2, 254, 2, {"loss": 4, "mlp": 3}), (4, 300, 1, {"loss": 8, "mlp": 2})])
def test_tiled_chains_are_exact_against_the_single_device(world, s, b, tiles):
    for loss, grads, ref_loss, ref_grads, tiling in run_ranks(_tiled_job, world, s, b, 256, 192, tiles):
        assert sorted((name, k) for name, k, _, _ in tiling) == \
            sorted([("loss", tiles["loss"]), ("mlp.0", tiles["mlp"]), ("mlp.1", tiles["mlp"])])
        assert_close(loss, ref_loss, "loss")
        for k in ref_grads:
            assert_close(grads[k], ref_grads[k], f"grad {k}")


def _budget_job(rank, world, s, vocab, inter, budget):
    """Under a byte budget the planner tiles by itself: (loss, grads, reference, measured peak, plan)."""
    from torch.distributed.device_mesh import init_device_mesh
    from autosp.memory import peak_bytes
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    torch.manual_seed(0)
    model = tiny_llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=vocab, intermediate_size=inter)
    fn, params = llama_loss(model), params_of(model)
    ids, labels = batch(1, s, vocab, pad=5)
    vg = autosp.value_and_grad(fn, mesh, memory_budget=budget)
    loss, grads = vg(params, ids, labels)                     # compiles outside the measurement
    measured, _ = peak_bytes(lambda: vg(params, ids, labels))
    plan = vg.sharded.plan(autosp.api._differentiable(params), ids, labels)
    return loss, grads, *reference(fn, params, ids, labels), measured, plan


@pytest.mark.parametrize("vocab,inter,budget,wide", [
    (32_000, 128, 200 * 2**20, 2048 * 32_000 * 4),     # the loss head: one rank's fp32 logits are 262 MB
    (128, 4096, 24 * 2**20, 2048 * 4096 * 4),          # the MLP: one intermediate is 33.5 MB
])
def test_the_planner_tiles_when_the_budget_needs_it_and_the_peak_stays_below_one_wide_value(vocab, inter, budget,
                                                                                              wide):
    for loss, grads, ref_loss, ref_grads, measured, plan in run_ranks(_budget_job, 2, 4096, vocab, inter, budget):
        assert plan.tiling, str(plan)
        assert measured < wide and measured <= 1.05 * budget, (measured, wide, budget, str(plan))
        assert_peak(plan.peak_bytes, measured, atol=512, rtol=1e-4, what="tiled under the budget")
        assert_close(loss, ref_loss, "loss")
        for k in ref_grads:
            assert_close(grads[k], ref_grads[k], f"grad {k}")
