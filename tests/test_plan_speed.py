"""What makes `autosp plan` fast changes no answer: the probe's two processes hand each other the replay's joint
(run/plan.py, _Shared) and price the plan exactly as one process alone does."""
import json
import os
import time

import numpy as np
import torch


def test_the_probes_lend_the_replays_joint_and_price_as_one_process(tmp_path, monkeypatch):
    """Each side waits here for what the other hands over (the planner never does: a side that finds nothing
    derives it itself), so the lend happens whatever the timing; the Probe equals the one process's, number for
    number."""
    from autosp.run import plan
    from autosp.run.meshes import fake_world, planning_mesh
    from autosp.run.models import model_config
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}))
    spec = model_config(str(tmp_path))
    get, handed = plan._Shared.get, []

    def waiting(self, name):
        if name in (self.SEARCHED, self.LENT):
            deadline = time.monotonic() + 120
            while not os.path.exists(self._path(name)) and time.monotonic() < deadline:
                time.sleep(0.01)
        return get(self, name)
    monkeypatch.setattr(plan._Shared, "get", waiting)
    close = plan._Shared.close
    monkeypatch.setattr(plan._Shared, "close", lambda self: handed.append(sorted(os.listdir(self.dir))) or close(self))
    with fake_world(2):
        tracer = plan.Tracer(spec, planning_mesh(2, 1), torch.float32, 1, 2, shard_params=True)
        both = plan.probe(tracer, 512, 2048, "cpu", False, parallel=True)
        alone = plan.probe(tracer, 512, 2048, "cpu", False, parallel=False)
    assert handed[0] == sorted(["512.trace", "2048.trace", plan._Shared.SEARCHED, plan._Shared.LENT]), handed
    assert (both.least, both.decisions, both.tiling, both.method) == (alone.least, alone.decisions, alone.tiling,
                                                                    alone.method)
    assert both.decisions[1], "the least-peak plan recomputes nothing: the replay would not test a plan"
    for a, b in [(both.profiles[k], alone.profiles[k]) for k in alone.profiles] + \
            [(both.plan[k], alone.plan[k]) for k in alone.plan]:
        assert np.array_equal(a.values, b.values) and np.array_equal(a.saved, b.saved)
        assert (a.comm, a.host, a.shape) == (b.comm, b.host, b.shape) and np.array_equal(a.terms, b.terms)


def test_a_verdict_stops_at_the_first_plan_within_its_budget_with_the_same_verdict(monkeypatch):
    """plan_step's `enough` (at_length's quick verdicts, autosp plan's checks): the most tiled step searched first,
    the untiled one not where a plan of the first is within it, and the search stops at the first plan within it
    (no remat, then per-layer checkpointing, before any MIP); where nothing is within it, the least of all, as
    without it."""
    import autosp.remat as remat
    import autosp.remat.plan as remat_plan
    from autosp.run import plan
    from autosp.run.meshes import fake_world, planning_mesh
    from autosp.run.models import model_config
    searched = []
    make_plan = remat.make_plan
    monkeypatch.setattr(remat, "make_plan", lambda joint, *a, **k: searched.append(len(joint.graph.eqns))
                        or make_plan(joint, *a, **k))
    mips, descend = [], remat_plan._descend
    monkeypatch.setattr(remat_plan, "_descend", lambda *a, **k: mips.append(1) or descend(*a, **k))
    monkeypatch.setenv("AUTOSP_PLAN_CACHE", "off")
    with fake_world(2):
        tracer = plan.Tracer(model_config("tiny"), planning_mesh(2), torch.float32, 1, 2, shard_params=True)
        local = tracer.trace(1024, single=False).local
        least = remat.plan_step(local, "least", refine=False, plan_only=True)[0]
        both = list(searched)
        searched.clear()
        first = remat.plan_step(local, "least", refine=False, plan_only=True, enough=2 ** 40)[0]
        one = list(searched)
        searched.clear()
        all_mips = len(mips)
        mips.clear()
        at_least = least.peak_bytes + least.const_bytes
        seeded = remat.plan_step(local, "least", refine=False, plan_only=True, enough=at_least)[0]
        seeded_mips = len(mips)
        searched.clear()
        none = remat.plan_step(local, "least", refine=False, plan_only=True, enough=1)[0]
        searched_none = list(searched)
        under = remat.plan_step(local, "least", refine=False, plan_only=True, enough=at_least - 1)[0]
    assert len(both) == 2 and one == both[:1], (both, one)        # the tiled step, then the untiled one
    assert first.peak_bytes + first.const_bytes <= 2 ** 40 and first.tiling
    assert first.peak_bytes == first.no_remat_peak_bytes and first.method == "saving everything"   # within 1 TiB
    # the least here is per-layer checkpointing's: within its own bytes, the seeds answer, no MIP is solved
    assert least.method.startswith("per-layer checkpointing") and all_mips >= 1 and seeded_mips == 0
    assert seeded.peak_bytes + seeded.const_bytes <= at_least and seeded.method.startswith("per-layer")
    assert (none.peak_bytes, none.tiling) == (least.peak_bytes, least.tiling) and searched_none == both
    assert (under.peak_bytes, under.tiling) == (least.peak_bytes, least.tiling)


def test_a_refused_verdict_searches_its_next_end_on_the_idle_core_with_the_same_verdict(monkeypatch):
    """remat/helper.py: where a core is idle (helper.idle_core; in `autosp plan`'s rounds, the other verdict's once
    it has ended), a verdict's search forks a helper for its next end (the untiled step) as it starts. A refused
    verdict takes the helper's least and derives its programs; a fit stops it unused. Either way the answer is
    the one searched in one process."""
    import autosp.remat as remat
    from autosp.remat import simulate_step
    from autosp.remat.helper import Helper, idle_core
    from autosp.run import plan
    from autosp.run.meshes import fake_world, planning_mesh
    from autosp.run.models import model_config
    monkeypatch.setenv("AUTOSP_PLAN_CACHE", "off")
    took, stopped = [], []
    take, stop = Helper.take, Helper.stop
    monkeypatch.setattr(Helper, "take", lambda self: took.append(take(self)) or took[-1])
    monkeypatch.setattr(Helper, "stop", lambda self: stopped.append(self.pid is not None) or stop(self))
    with fake_world(2):
        tracer = plan.Tracer(model_config("tiny"), planning_mesh(2), torch.float32, 1, 2, shard_params=True)
        local = tracer.trace(1024, single=False).local
        least = remat.plan_step(local, "least", refine=False, plan_only=True)[0]
        budget = least.peak_bytes + least.const_bytes - 1
        alone = remat.plan_step(local, "least", refine=False, plan_only=True, enough=budget)
        assert not took and not stopped                     # no idle core: no helper
        with idle_core():
            helped = remat.plan_step(local, "least", refine=False, plan_only=True, enough=budget)
            fit = remat.plan_step(local, "least", refine=False, plan_only=True, enough=2 ** 40)[0]
    assert len(took) == 1 and took[0] is not None, took     # the refused one took the untiled step's least
    assert stopped == [True], stopped                       # the fit stopped its helper at the first end
    a, b = alone[0], helped[0]
    assert (b.peak_bytes, b.tiling, b.method, b.decisions) == (a.peak_bytes, a.tiling, a.method, a.decisions)
    assert b.peak_bytes + b.const_bytes > budget and fit.peak_bytes + fit.const_bytes <= 2 ** 40
    assert int(simulate_step(helped[1], "cpu").peak) == b.peak_bytes
