"""A joint program re-instantiated at another sequence length (autosp/passes/rescale.py) is the joint
differentiated at that length, equation for equation; where a size is ambiguous it is refused and the
joint differentiated instead; and a step compiled at a second length from a rescaled joint is exact."""
import pytest
import torch

import autosp
from autosp.run.meshes import fake_world, planning_mesh
from tests.dist import run_ranks
from tests.models import assert_every_rank, rank_errors, reference


def _graphs(s: int, sp: int = 2, hidden: int = 64, heads: int = 4, kv: int = 2, layers: int = 2, packed=False):
    """(global, per-rank) graphs of a tiny Llama's loss at length s on a planning mesh of sp ranks."""
    from tests.models import llama_loss, tiny_llama
    model = tiny_llama(layers=layers, hidden=hidden, heads=heads, kv_heads=kv, vocab=256, device="meta")
    params = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
    ids = torch.zeros(1, s, dtype=torch.long, device="meta")
    if not packed:
        return autosp.shard(llama_loss(model), planning_mesh(sp)).graphs(params, ids, ids)

    def loss(params, input_ids, labels, position_ids):           # two documents, positions restart
        return torch.func.functional_call(model, params, (input_ids,),
                                          {"labels": labels, "position_ids": position_ids}).loss
    pos = torch.cat([torch.arange(s // 2), torch.arange(s - s // 2)]).reshape(1, s).to("meta")
    return autosp.shard(loss, planning_mesh(sp)).graphs(params, ids, ids, pos)


def _same(a, b) -> bool:
    return str(a.graph).split("\n", 1)[1] == str(b.graph).split("\n", 1)[1] and a.boundary == b.boundary


@pytest.mark.parametrize("case", ["sp2", "sp2-tiled", "no-sp", "ring", "packed"])
def test_a_rescaled_joint_is_the_joint_differentiated_at_the_other_length(case):
    from autosp.passes.autodiff import differentiate, split_boundary
    from autosp.passes.rescale import rescale
    from autosp.passes.tile import find_chains, tile
    from autosp.remat import tiling_levels
    sp = 8 if case == "ring" else 2                        # 4 heads over 8 ranks: all-to-all 4 x ring 2
    with fake_world(sp):
        steps = []
        for s in (768, 1536):
            g, local = _graphs(s, sp, packed=case == "packed")
            graph = g if case == "no-sp" else local
            if case == "sp2-tiled":
                chains = find_chains(graph)
                graph = tile(graph, tiling_levels(chains)[-1], chains)
                assert "split_with_sizes" in str(graph)
            steps.append(split_boundary(graph).graph)
        a, b = steps
        ja, jb = differentiate(a), differentiate(b)
        jr = rescale(ja, a, b)
        assert _same(jr, jb), case
        assert jr.graph.name == "rescale"
        assert _same(rescale(jb, b, a), ja), case            # and back down


def test_rescale_refuses_an_ambiguous_size_and_joint_of_differentiates_instead():
    from autosp.passes.autodiff import differentiate, split_boundary
    from autosp.passes.rescale import RescaleError, rescale
    from autosp.remat import _JOINTS, joint_of
    with fake_world(2):
        # at 128 tokens the length is also the MLP's width, and each rank's 64 the hidden size: which of
        # them move cannot be told
        a = split_boundary(_graphs(128)[1]).graph
        b = split_boundary(_graphs(512)[1]).graph
        with pytest.raises(RescaleError, match="(128|64) moves to .* and stays"):
            rescale(differentiate(a), a, b)
        # two different programs (2 and 3 layers) are refused as such
        c = split_boundary(_graphs(512, layers=3)[1]).graph
        with pytest.raises(RescaleError, match="different programs|equation"):
            rescale(differentiate(b), b, c)
        _JOINTS.clear()
        joint_of(_graphs(128)[1])
        got = joint_of(_graphs(512)[1])[1]
        assert got.graph.name == "differentiate" and _same(got, differentiate(b))
        # an unambiguous pair is rescaled by joint_of (at 512 each rank's 256 is the vocabulary too)
        joint_of(_graphs(768)[1])
        assert joint_of(_graphs(1536)[1])[1].graph.name == "rescale"


def _two_lengths_job(rank, world):
    """One process compiles the step at 322 tokens, then at 450 (both ragged over 4 ranks: chunks of 81 and
    113, padded to 324 and 452): the second joint is the first re-instantiated; both lengths run exactly
    against the single device."""
    from torch.distributed.device_mesh import init_device_mesh
    from autosp.remat import _JOINTS
    from tests.models import batch, llama_loss, params_of, tiny_llama
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    torch.manual_seed(0)
    model = tiny_llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128)
    fn, params = llama_loss(model), params_of(model)
    _JOINTS.clear()
    out = {}
    vg = autosp.value_and_grad(fn, mesh, memory_budget=0.8)        # a budget: the step runs the joint's plan
    for s in (322, 450):
        ids, labels = batch(1, s, 128, pad=3)
        ref_loss, ref_grads = reference(fn, params, ids, labels)
        loss, grads = vg(params, ids, labels)
        out[f"s={s}"] = rank_errors(loss, grads, ref_loss, ref_grads)
    names = sorted({j.graph.name for _, j, _ in _JOINTS.values()})
    return out, names


def test_a_step_compiled_at_a_second_length_from_a_rescaled_joint_is_exact():
    results = run_ranks(_two_lengths_job, 4)
    assert_every_rank([r for r, _ in results])
    for _, names in results:
        assert "rescale" in names, names


def test_a_count_or_scale_new_to_the_forwards_is_refused():
    """An int the backward makes from a size that moves (a mean's element count, L / P x 64) or a float that
    is one or its inverse would stay where it should move: a wrong value, not a wrong shape."""
    from autosp.passes.rescale import RescaleError, Sizes
    sizes = Sizes()
    sizes.shapes((1, 768, 64), (1, 1536, 64), lambda: "x")
    sizes.freeze()
    assert sizes.move(768) == 1536 and sizes.move(64) == 64 and sizes.move(-1) == -1 and sizes.move(0) == 0
    assert sizes.move(1 / 64) == 1 / 64 and sizes.move(1e-5) == 1e-5
    assert sizes.position(2 * 768) == 2 * 1536 and sizes.position(1) == 1      # a tile's offset, a shift
    for bad in (768 * 64, 768.0, 1 / (768 * 64)):
        with pytest.raises(RescaleError, match="cannot be told"):
            sizes.move(bad)


@pytest.mark.parametrize("case", ["sp2", "no-sp", "ring", "packed"])
def test_a_forward_placed_on_the_line_through_two_traces_is_the_trace_at_that_length(case):
    """passes/rescale.extrapolate: the forward at a third length (above, between and below the two traced),
    without tracing it, is the trace there, equation for equation; a length whose sizes are no ints on the line
    (each rank's L / P at 770 over 4 ranks) is refused."""
    from autosp.passes.rescale import RescaleError, extrapolate
    sp = 8 if case == "ring" else 2
    pick = (lambda g, local: g) if case == "no-sp" else (lambda g, local: local)
    with fake_world(sp):
        a, b = (pick(*_graphs(s, sp, packed=case == "packed")) for s in (768, 1536))
        for s in (3072, 1024, 256):
            got, want = extrapolate(a, 768, b, 1536, s), pick(*_graphs(s, sp, packed=case == "packed"))
            assert str(got) == str(want) and got.in_spec == want.in_spec, (case, s)
        if case == "ring":
            with pytest.raises(RescaleError, match="no positive int"):
                extrapolate(a, 768, b, 1536, 770)


def test_a_size_that_grows_otherwise_than_in_proportion_is_not_extrapolated():
    """A program whose shapes hold L x L (a flattened score matrix) at two lengths: the line through them says the
    wrong size at a third, and the equation that makes it says so (RescaleError): the caller traces instead."""
    from autosp.passes.rescale import RescaleError, extrapolate
    from autosp.trace import trace

    def f(x):
        return (x.unsqueeze(-1) * x.unsqueeze(-2)).reshape(-1).sum()
    a, b = (trace(f, torch.zeros(s, device="meta")) for s in (96, 160))
    with pytest.raises(RescaleError):
        extrapolate(a, 96, b, 160, 224)


def test_autosp_plan_checks_its_answer_on_forwards_placed_on_the_probes_line():
    """After two traces of one step (the probe's), Tracer.local gives the forward at any other length from them,
    the trace's equal, without tracing; a step of other flags is traced."""
    import argparse

    from autosp.run import plan as run_plan
    from autosp.run.answer import _as_ranks_run, _tracer
    from autosp.run.config import add_step_flags, step_of
    from autosp.run.models import spec_of
    p = argparse.ArgumentParser()
    add_step_flags(p, "plan")
    step = step_of(p.parse_args(["--model", "tiny", "--sp", "2", "--memory", "1GiB"]), "plan")
    run_plan._TRACED.clear()
    with fake_world(step.world), _as_ranks_run(step):
        tracer = _tracer(step, spec_of(step))
        for s in (1024, 4096):
            tracer.trace(s, single=False)
        def no_trace(*args, **kwargs):
            raise AssertionError("traced: the two traces' line was not used")
        tracer._graphs = no_trace
        got = tracer.local(2560)
        del tracer._graphs
        run_plan._TRACED.clear()
        assert str(got) == str(tracer.trace(2560, single=False).local)
