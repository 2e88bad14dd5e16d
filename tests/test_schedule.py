"""Collectives started early and waited late (passes/schedule.py, autosp.inflight), on real gloo processes.

One 2-rank job (a 2-layer Llama-style model with its parameters sharded, s=64, budget 1.0 and 0.8) reads the
programs the runtime runs: every all-to-all, parameter gather and gradient reduce-scatter is a start, a wait and its
result; an all-to-all starts right after its last input is made; a gather waits at its parameter's first use, work
between; the reduce-scatters keep at most two layers' gradients in flight. The step is exact against one device,
bit for bit the blocking schedule's (AUTOSP_OVERLAP=0), nothing is left in flight after it, and explain says where
each collective starts and is waited.

The same program planned in one process (a fake world of 2 ranks) is held to what the cost model says each kind of
collective hides: the share of its transfer under the work between its start and wait, views not counted as work.
"""
import pytest
import torch

from tests.dist import run_ranks
from tests.models import assert_every_rank

BLOCKING = ("all_to_all", "all_gather_param", "reduce_scatter_param")


def _programs(step, args):
    return step.compile(*args)[1].program


def _is_view(e) -> bool:
    """Every output shares an input's storage (detach, view, t, unsqueeze, ...): no work to hide a transfer under."""
    from autosp.ir.aliases import aliases
    return bool(e.outputs) and all(a is not None for a in aliases(e))


def _windows(graph):
    """(start index, wait index, equations of work between, views between) of every posted collective, found here
    (not by passes/schedule's own helpers): a start's landing buffer is its last output, its wait's last input."""
    from autosp.passes.schedule import STARTS
    eqns = graph.eqns
    waits = {e.inputs[-1].name: k for k, e in enumerate(eqns) if e.op.name == "wait_collective"}
    out = []
    for s, e in enumerate(eqns):
        if e.op.name not in STARTS:
            continue
        w = waits[e.outputs[-1].name]
        inner = [x for x in eqns[s + 1:w] if x.op.name not in STARTS and x.op.name != "wait_collective"]
        out.append((s, w, [x for x in inner if not _is_view(x)], [x for x in inner if _is_view(x)]))
    return out


def _check_program(graph, shapes: bool) -> dict:
    """Structural facts of one scheduled program (asserted here, summarised for the test). `shapes`: verify the
    shapes too (not a backward program: its saved inputs would enter verify contiguous, and a saved all-to-all
    output is not). Equations between a start and its wait are counted where they do work (views are not)."""
    from autosp.ir import verify
    from autosp.passes.schedule import STARTS
    verify(graph, shapes=shapes)
    eqns = graph.eqns
    assert not [e.op.name for e in eqns if e.op.name in BLOCKING], "a blocking collective is left"
    made = {o.name: k for k, e in enumerate(eqns) for o in e.outputs}
    waits = {e.inputs[-1].name: k for k, e in enumerate(eqns) if e.op.name == "wait_collective"}
    facts = {"a2a_between": [], "kv_a2a_between": [], "gather_between": [], "rs_in_flight": 0}
    rs = set()                                      # reduce-scatters posted, not yet waited
    for k, e in enumerate(eqns):
        if e.op.name in STARTS:
            landing = e.outputs[-1].name
            w = waits[landing]                      # every start is waited, after it
            assert w > k, (e.format(), w)
            between = sum(1 for x in eqns[k + 1:w]
                          if x.op.name not in STARTS and x.op.name != "wait_collective" and not _is_view(x))
            if e.op.name == "all_to_all_start":
                # started right after the last of its inputs is made
                assert max(made.get(x.name, -1) for x in e.inputs) == k - 1 or k == 0, e.format()
                facts["a2a_between"].append(between)
                if len(e.inputs) == 2:              # keys_first: K and V's, Q's projection before its wait
                    facts["kv_a2a_between"].append(between)
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
            # forward: the gathers a layer ahead leave work between start and wait, and so does K and V's all-to-all
            # (Q projected and rotated while they are in flight)
            assert fwd["gather_between"] and max(fwd["gather_between"]) > 0, (budget, fwd)
            assert fwd["kv_a2a_between"] and min(fwd["kv_a2a_between"]) > 0, (budget, fwd)
            # backward: attention's gradient all-to-alls have nothing but views (detach, unsqueeze) between start and
            # wait (test_each_kind_hides_its_share_of_the_transfer: they hide nothing)
            assert bwd["a2a_between"] and max(bwd["a2a_between"]) == 0, (budget, bwd)
            # reduce-scatters: at most two layers' in flight (the one waited as the next starts)
            assert 0 < bwd["rs_in_flight"] <= 2 * per_layer + 2, (budget, bwd, per_layer)
        assert "# collectives started early, waited late" in text, text[:2000]
        assert "forward all_gather_param x" in text and "backward reduce_scatter_param x" in text
        assert "= all_to_all_start(" in text and "_ = wait_collective([" in text, text[-3000:]


# (program, kind) -> the least share of its transfer the cost model hides under the work between start and wait
# (views not counted), per kind, on the 2-layer model at budget 0.8 (explain's figures, bench/RESULTS.md
# "Collectives started early, waited late"): measured 0.83 (gathers), 0.12 (all-to-alls: K and V's under Q's
# projection, Q's and the output's under nothing), 0.88 (reduce-scatters); held to about half of each.
HIDDEN_AT_LEAST = {
    ("forward", "all_gather_param"): 0.4,
    ("forward", "all_to_all"): 0.06,
    ("backward", "reduce_scatter_param"): 0.4,
}
# Attention's gradient all-to-alls: the first starts right after its input (the o_proj input gradient) with only
# detach between it and attention's backward, which reads it; o_proj's weight gradient, which does not, runs before
# the start (place_collectives moves starts up, never independent work down); the second is read at once by the
# rotary backward. When the schedule puts work under them, this fails: move the kind to HIDDEN_AT_LEAST.
HIDES_NOTHING = {("backward", "all_to_all")}


def _planned_step(budget):
    """The scheduled forward and backward programs of the 2-layer model (parameters sharded, s=64, SP=2) planned at
    `budget` in this process (a fake world of 2 ranks, meta tensors), and the remat program before scheduling."""
    import autosp
    from autosp.passes.schedule import schedule_program
    from autosp.remat import plan_step
    from autosp.run.meshes import fake_world, planning_mesh
    from tests.models import llama_loss, tiny_llama
    with fake_world(2):
        mesh = planning_mesh(2)
        model = tiny_llama(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, device="meta")
        params = autosp.shard_params({k: v.detach().requires_grad_(True) for k, v in model.named_parameters()},
                                     mesh)
        ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
        local = autosp.shard(llama_loss(model), mesh).graphs(autosp.api._differentiable(params), ids, ids)[1]
        program = plan_step(local, budget, device="cpu")[1]
        return schedule_program(program), program


def test_each_kind_hides_its_share_of_the_transfer():
    """Per kind of collective (forward gathers and all-to-alls, backward all-to-alls and reduce-scatters), the
    share of its transfer the cost model hides: per collective, the seconds of the equations of work between its
    start and wait (a view is none: it aliases its input) up to its transfer's seconds, summed over the kind. The
    windows are found here, and passes/schedule.overlaps and explain's summary must say the same: the same count of
    equations of work (views left out: attention's gradient all-to-alls have only views between, and report 0), the
    same seconds under each transfer."""
    import re
    from autosp.passes.schedule import overlap_summary, overlaps
    from autosp.remat.cost import device_for, eqn_cost
    dev = device_for("cpu")
    scheduled, program = _planned_step(0.8)
    shares, counts, views_only, with_views = {}, {}, 0, 0
    for part, graph in (("forward", scheduled.forward), ("backward", scheduled.backward)):
        rows = {(r[1], r[2]): r for r in overlaps(graph, dev)}
        mine = _windows(graph)
        assert sorted(rows) == sorted((s, w) for s, w, _, _ in mine), part
        for s, w, work, views in mine:
            kind, _, _, n, _, under, transfer = rows[(s, w)]
            where = f"{part} {kind} at {s}..{w}: {[x.op.name for x in work]} of work, {[x.op.name for x in views]}"
            assert n == len(work), f"{where}: overlaps counts {n} equations of work"
            assert under == pytest.approx(sum(eqn_cost(x, dev).seconds for x in work), rel=1e-12, abs=0), where
            assert transfer == pytest.approx(eqn_cost(graph.eqns[s], dev).seconds, rel=1e-12), where
            views_only += bool(views) and not work
            with_views += bool(views)
            hidden, total = shares.get((part, kind), (0.0, 0.0))
            shares[(part, kind)] = (hidden + min(under, transfer), total + transfer)
            counts.setdefault((part, kind), []).append(len(work))
    # the count is tested where it matters: windows with views in them, some with nothing else
    assert with_views > 10 and views_only >= 4, (with_views, views_only)
    fraction = {k: hidden / total for k, (hidden, total) in shares.items()}
    print("share of each kind's transfer hidden (cost model, budget 0.8): "
          + ", ".join(f"{p} {k} {f:.3f}" for (p, k), f in sorted(fraction.items())))
    assert set(fraction) == set(HIDDEN_AT_LEAST) | HIDES_NOTHING, sorted(fraction)
    for key, least in HIDDEN_AT_LEAST.items():
        assert fraction[key] >= least, f"{key}: {fraction[key]:.3f} of the transfer hidden, held to {least}"
    for key in HIDES_NOTHING:
        assert fraction[key] == 0 and max(counts[key]) == 0, (
            f"{key}: {fraction[key]:.3f} hidden under {counts[key]} equations of work: the schedule hides it now, "
            "move it to HIDDEN_AT_LEAST")
    # explain's summary: per kind the median count of equations of work and the milliseconds hidden, as found here
    text = overlap_summary(program, dev)
    for (part, kind), (hidden, total) in shares.items():
        n = sorted(counts[(part, kind)])
        line = next(x for x in text.splitlines() if x.startswith(f"  {part} {kind} x{len(n)}:"))
        got = re.search(r"; (\d+) equations of work between start and wait \(median, (\d+)-(\d+); views not "
                        r"counted\); transfer ([\d.e+-]+) ms, ([\d.e+-]+) ms of it under compute", line)
        assert got, line
        assert [int(x) for x in got.groups()[:3]] == [n[len(n) // 2], n[0], n[-1]], line
        assert float(got[4]) == float(f"{total * 1e3:.3g}") and float(got[5]) == float(f"{hidden * 1e3:.3g}"), line
