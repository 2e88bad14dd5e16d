"""Collectives started early and waited late (passes/schedule.py, autosp.inflight), on real gloo processes.

One 2-rank job (a 2-layer Llama-style model with its parameters sharded, s=64, budget 1.0 and 0.8) reads the
programs the runtime runs: every all-to-all, parameter gather and gradient reduce-scatter is a start, a wait and its
result; an all-to-all starts right after its last input is made; a gather waits at its parameter's first use, work
between; the reduce-scatters keep at most two layers' gradients in flight. The step is exact against one device,
bit for bit the blocking schedule's (AUTOSP_OVERLAP=0), nothing is left in flight after it, and explain says where
each collective starts and is waited.
"""
import torch

from tests.dist import run_ranks
from tests.models import assert_every_rank

BLOCKING = ("all_to_all", "all_gather_param", "reduce_scatter_param")


def _programs(step, args):
    return step.compile(*args)[1].program


def _check_program(graph, shapes: bool) -> dict:
    """Structural facts of one scheduled program (asserted here, summarised for the test). `shapes`: verify the
    shapes too (not a backward program: its saved inputs would enter verify contiguous, and a saved all-to-all
    output is not)."""
    from autosp.ir import verify
    from autosp.passes.schedule import STARTS
    verify(graph, shapes=shapes)
    eqns = graph.eqns
    assert not [e.op.name for e in eqns if e.op.name in BLOCKING], "a blocking collective is left"
    made = {o.name: k for k, e in enumerate(eqns) for o in e.outputs}
    waits = {e.inputs[-1].name: k for k, e in enumerate(eqns) if e.op.name == "wait_collective"}
    facts = {"a2a_between": [], "gather_between": [], "rs_in_flight": 0}
    rs = set()                                      # reduce-scatters posted, not yet waited
    for k, e in enumerate(eqns):
        if e.op.name in STARTS:
            landing = e.outputs[-1].name
            w = waits[landing]                      # every start is waited, after it
            assert w > k, (e.format(), w)
            between = sum(1 for x in eqns[k + 1:w] if x.op.name not in STARTS and x.op.name != "wait_collective")
            if e.op.name == "all_to_all_start":
                # started right after the last of its inputs is made
                assert max(made.get(x.name, -1) for x in e.inputs) == k - 1 or k == 0, e.format()
                facts["a2a_between"].append(between)
            elif e.op.name == "all_gather_param_start":
                facts["gather_between"].append(between)
            else:
                rs.add(landing)
                facts["rs_in_flight"] = max(facts["rs_in_flight"], len(rs))
        elif e.op.name == "wait_collective":
            rs.discard(e.inputs[-1].name)
    return facts


def _job(rank, world):
    import os

    import autosp
    from autosp.inflight import in_flight
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import batch, llama_loss, params_of, rank_errors, reference, tiny_llama
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    torch.manual_seed(0)
    model = tiny_llama(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64)
    fn, params = llama_loss(model), params_of(model)
    ids, labels = batch(1, 64, 64, pad=3)
    ref_loss, ref_grads = reference(fn, params, ids, labels)
    per_layer = sum(k.startswith("model.layers.0.") for k in params)
    errors, facts, results = {}, {}, {}
    for overlap in ("1", "0"):
        os.environ["AUTOSP_OVERLAP"] = overlap
        try:
            for budget in (1.0, 0.8):
                sharded = {k: v.requires_grad_(True) for k, v in autosp.shard_params(params, mesh).items()}
                vg = autosp.value_and_grad(fn, mesh, memory_budget=budget)
                loss, grads = vg(sharded, ids, labels)
                assert in_flight() == 0
                full = {k: g.full_tensor() for k, g in grads.items()}
                results[(overlap, budget)] = (loss, full)
                if overlap == "1":
                    errors[f"budget {budget}"] = rank_errors(loss, full, ref_loss, ref_grads)
                    prog = _programs(vg.sharded, (autosp.api._differentiable(sharded), ids, labels))
                    facts[budget] = (_check_program(prog.forward, True), _check_program(prog.backward, False))
        finally:
            os.environ.pop("AUTOSP_OVERLAP", None)
    for budget in (1.0, 0.8):                       # the same numbers as the blocking schedule, bit for bit
        (l1, g1), (l0, g0) = results[("1", budget)], results[("0", budget)]
        assert torch.equal(l1, l0) and all(torch.equal(g1[k], g0[k]) for k in g1), budget
    sharded = {k: v.requires_grad_(True) for k, v in autosp.shard_params(params, mesh).items()}
    text = autosp.explain(fn, mesh, sharded, ids, labels, memory_budget=0.8)
    return errors, facts, per_layer, text


def test_collectives_start_early_wait_late_and_change_nothing():
    results = run_ranks(_job, 2)
    assert_every_rank([errors for errors, _, _, _ in results])
    for _, facts, per_layer, text in results:
        print("\n".join(line for line in text.splitlines() if line.startswith(("# collectives", "  forward ",
                                                                             "  backward "))))
        for budget, (fwd, bwd) in facts.items():
            print(f"budget {budget}: forward {fwd}, backward {bwd}")
            # forward: the gathers a layer ahead leave work between start and wait
            assert fwd["gather_between"] and max(fwd["gather_between"]) > 0, (budget, fwd)
            # backward: attention's gradient all-to-alls have the weight gradients beside them
            assert bwd["a2a_between"] and max(bwd["a2a_between"]) > 0, (budget, bwd)
            # reduce-scatters: at most two layers' in flight (the one waited as the next starts)
            assert 0 < bwd["rs_in_flight"] <= 2 * per_layer + 2, (budget, bwd, per_layer)
        assert "# collectives started early, waited late" in text, text[:2000]
        assert "forward all_gather_param x" in text and "backward reduce_scatter_param x" in text
        assert "= all_to_all_start(" in text and "_ = wait_collective([" in text, text[-3000:]
