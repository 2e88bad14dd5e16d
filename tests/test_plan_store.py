"""The plan cache (autosp/remat/store.py): a step planned once is read back, not planned again, and runs as the plan
made it, its peak simulated again; the key changes with everything a plan depends on; a refusal is kept with its
least; a plan from a MIP cut short by its time limit is not kept; what cannot be read is planned again; an entry or
folder not the user's alone is ignored, said once; the folder autosp makes is 0o700, an entry 0o600;
AUTOSP_PLAN_CACHE=off keeps nothing, and the suite runs with it off whatever the shell sets."""
import os
import stat
import warnings

import pytest
import torch

import autosp
from autosp.remat import BudgetError, plan_step, store
from autosp.run.meshes import fake_world, planning_mesh
from tests.dist import run_ranks
from tests.models import assert_close as _close, reference as _reference


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """Plans kept in a folder of the test's own, planned in a fake world of 2 ranks (the planner traces the
    joint's collectives)."""
    folder = tmp_path / "plans"
    monkeypatch.setenv("AUTOSP_PLAN_CACHE", str(folder))
    monkeypatch.setattr(store, "_WARNED", False)       # each test sees the once-a-process warning
    with fake_world(2):
        yield folder


def _local(s: int = 256, layers: int = 2, sp: int = 2):
    import torch.distributed as dist

    from tests.models import llama_loss, tiny_llama
    torch.manual_seed(0)
    model = tiny_llama(layers=layers, hidden=64, heads=4, kv_heads=2, vocab=128, device="meta")
    params = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
    ids = torch.zeros(1, s, dtype=torch.long, device="meta")
    if dist.is_initialized() and dist.get_world_size() == sp:
        return autosp.shard(llama_loss(model), planning_mesh(sp)).graphs(params, ids, ids)[1]
    with fake_world(sp):
        return _local(s, layers, sp)


def _fresh_planning_fails(monkeypatch):
    import autosp.remat as remat

    def refuse(*args, **kwargs):
        raise AssertionError("planned again: the kept plan was not read")
    monkeypatch.setattr(remat, "_plan_now", refuse)


def test_a_planned_step_is_read_back_not_planned_again(kept, monkeypatch):
    from dataclasses import replace
    local = _local()
    plan, program, _, _ = plan_step(local, 0.6)
    assert plan.stored is None and len(list(kept.glob("*.plan"))) == 1
    _fresh_planning_fails(monkeypatch)
    again, program2, joint2, _ = plan_step(local, 0.6)
    assert again.stored == str(next(kept.glob("*.plan"))) and "read from the plan cache" in str(again)
    assert replace(again, stored=None) == plan
    assert any(d.action == "recompute" for d in plan.decisions)
    assert str(program2.forward) == str(program.forward) and str(program2.backward) == str(program.backward)
    only = plan_step(local, 0.6, plan_only=True)             # the verdict's path: the plan, nothing applied
    assert replace(only[0], stored=None) == plan and only[1:] == (None, None, None)


def test_the_key_is_what_a_plan_depends_on(monkeypatch):
    from autosp.remat.cost import device_for
    local = _local()
    cpu = device_for("cpu", None)
    base = store.key(local, 0.6, cpu)
    assert store.key(_local(), 0.6, cpu) == base                      # a trace of the same step: the same key
    others = [store.key(_local(s=192), 0.6, cpu), store.key(_local(layers=3), 0.6, cpu),
              store.key(_local(sp=4), 0.6, cpu), store.key(local, 0.5, cpu), store.key(local, "least", cpu),
              store.key(local, 0.6, device_for("cuda", None)), store.key(local, 0.6, device_for("cpu", 5e9)),
              store.key(local, 0.6, cpu, host_memory=2**20), store.key(local, 0.6, cpu, refine=False),
              store.key(local, 0.6, cpu, tiles={})]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)               # CPU attention's scratch, which the memory model counts
    try:
        others.append(store.key(local, 0.6, cpu))
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("AUTOSP_OVERLAP", "0")        # the programs the planner simulates, unscheduled
    others.append(store.key(local, 0.6, cpu))
    monkeypatch.delenv("AUTOSP_OVERLAP")
    import autosp.sources
    monkeypatch.setattr(autosp.sources, "digest", lambda: "other sources")
    others.append(store.key(local, 0.6, cpu))
    assert len(set(others)) == len(others) and base not in others


def test_a_refusal_is_kept_with_its_least(kept, monkeypatch):
    local = _local()
    with pytest.raises(BudgetError) as first:
        plan_step(local, 1024)
    assert first.value.least_peak_bytes > 1024
    _fresh_planning_fails(monkeypatch)
    with pytest.raises(BudgetError) as again:
        plan_step(local, 1024)
    assert str(again.value) == str(first.value) and again.value.least_peak_bytes == first.value.least_peak_bytes


def test_a_plan_cut_short_by_the_time_limit_is_not_kept(kept, monkeypatch):
    """Each MIP answers as HiGHS does when its time limit ends it, with the answer it would have given."""
    from scipy.optimize import OptimizeResult

    import autosp.remat.solve as solve
    real = solve.milp

    def limited(*args, **kwargs):
        res = real(*args, **kwargs)
        return OptimizeResult(dict(res, status=1, message="Time limit reached. (HiGHS Status 13: Time limit reached)"))
    monkeypatch.setattr(solve, "milp", limited)
    before = solve.time_limits()
    plan = plan_step(_local(), 0.6)[0]
    assert solve.time_limits() > before and plan.peak_bytes <= plan.budget_bytes
    assert not list(kept.glob("*.plan"))


def test_what_cannot_be_read_is_planned_again(kept):
    local = _local()
    plan = plan_step(local, 0.6)[0]
    (path,) = kept.glob("*.plan")
    path.write_bytes(path.read_bytes()[:100])                         # torn
    again = plan_step(local, 0.6)[0]
    assert again == plan and again.stored is None                     # planned, and written whole again
    assert plan_step(local, 0.6)[0].stored == str(path)


def test_off_keeps_nothing(kept, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSP_PLAN_CACHE", "off")
    assert store.folder() is None
    plan_step(_local(), 0.6)
    assert not kept.exists()
    monkeypatch.setenv("AUTOSP_PLAN_CACHE", str(tmp_path / "unwritable" / "x"))
    (tmp_path / "unwritable").write_text("a file where the folder would be")
    assert plan_step(_local(), 0.6)[0].stored is None                  # keeping fails silently; planning does not


def test_a_stored_peak_is_simulated_again(kept, monkeypatch):
    """The peak a read-back plan reports is the memory model's of the program it runs, not the one in the file."""
    from dataclasses import replace

    from autosp.ir.serial import dumps, loads
    local = _local()
    plan = plan_step(local, 0.6)[0]
    (path,) = kept.glob("*.plan")
    entry = loads(path.read_bytes())
    path.write_bytes(dumps((entry[0], replace(entry[1], peak_bytes=entry[1].peak_bytes + 12345), *entry[2:])))
    assert store.load(path.stem)[1].peak_bytes == plan.peak_bytes + 12345          # the file does say so
    _fresh_planning_fails(monkeypatch)
    again = plan_step(local, 0.6)[0]
    assert again.stored == str(path) and again.peak_bytes == plan.peak_bytes


def _ignored(fn) -> tuple:
    """(fn's result, the UserWarnings it gave)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in said if issubclass(w.category, UserWarning)]


def test_an_entry_others_may_write_is_ignored_and_said_once(kept):
    local = _local()
    plan = plan_step(local, 0.6)[0]
    (path,) = kept.glob("*.plan")
    os.chmod(path, 0o620)                                             # group-writable: anyone in it could plant code
    again, said = _ignored(lambda: plan_step(local, 0.6)[0])
    assert again.stored is None and again == plan                     # planned afresh, not unpickled
    assert len(said) == 1 and str(path) in said[0] and "writable by its group" in said[0]
    assert f"chmod go-w {path}" in said[0] and "AUTOSP_PLAN_CACHE=<a folder of your own>" in said[0]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600                 # rewritten, the user's alone
    os.chmod(path, 0o606)
    again, said = _ignored(lambda: plan_step(local, 0.6)[0])
    assert again.stored is None and said == []                        # once a process
    assert plan_step(local, 0.6)[0].stored == str(path)


def test_an_entry_of_another_user_is_ignored(kept, monkeypatch):
    """The owner is another uid as fstat sees the opened entry (no second account needed)."""
    local = _local()
    plan_step(local, 0.6)
    (path,) = kept.glob("*.plan")
    real = os.fstat

    def someone_elses(fd):
        st = real(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid + 1, *st[5:]))
    monkeypatch.setattr(store.os, "fstat", someone_elses)
    entry, said = _ignored(lambda: store.load(path.stem))
    monkeypatch.setattr(store.os, "fstat", real)
    assert entry is None and len(said) == 1 and str(path) in said[0]
    assert f"belongs to uid {os.getuid() + 1}, not to this process's uid {os.getuid()}" in said[0]
    assert "AUTOSP_PLAN_CACHE=<a folder of your own>" in said[0]
    assert store.load(path.stem) is not None


def test_a_folder_not_the_users_alone_is_neither_read_nor_written(kept, monkeypatch):
    local = _local()
    plan_step(local, 0.6)
    (path,) = kept.glob("*.plan")
    os.chmod(kept, 0o777)
    again, said = _ignored(lambda: plan_step(local, 0.6)[0])
    assert again.stored is None and len(said) == 1
    assert f"{kept} is ignored" in said[0] and "writable by its group and other users" in said[0]
    assert f"chmod go-w {kept}" in said[0]
    path.unlink()
    plan_step(local, 0.6)
    assert not list(kept.glob("*.plan"))                              # nothing written into it either
    os.chmod(kept, 0o700)
    monkeypatch.setattr(store, "_WARNED", False)
    monkeypatch.setattr(store, "_uid", lambda: os.getuid() + 1)       # the folder's owner is not this process
    again, said = _ignored(lambda: plan_step(local, 0.6)[0])
    assert again.stored is None and len(said) == 1 and f"{kept} is ignored" in said[0] and "belongs to uid" in said[0]
    assert not list(kept.glob("*.plan"))


def test_the_folder_autosp_makes_is_private(tmp_path, monkeypatch):
    """Every folder autosp makes is 0o700 whatever the umask (parents included); an entry is 0o600."""
    where = tmp_path / "a" / "b" / "plans"
    monkeypatch.setenv("AUTOSP_PLAN_CACHE", str(where))
    os.chmod(tmp_path, 0o755)
    old = os.umask(0o002)                                             # a umask that would leave them group-writable
    try:
        store.save("0" * 64, ("refused", "no plan", 123))
    finally:
        os.umask(old)
    for made in (where, where.parent, where.parent.parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755             # there before: not autosp's to change
    (entry,) = where.iterdir()
    assert entry.name == "0" * 64 + ".plan" and stat.S_IMODE(entry.stat().st_mode) == 0o600
    assert store.load("0" * 64) == ("refused", "no plan", 123)


def test_the_suite_plans_afresh_whatever_the_shell_sets(tmp_path, monkeypatch):
    """tests/conftest.py assigns AUTOSP_PLAN_CACHE=off: a user's own cache (set in the shell before pytest) would
    serve plans to the suite's tests instead of the planner they test."""
    import runpy
    assert os.environ["AUTOSP_PLAN_CACHE"] == "off" and store.folder() is None
    monkeypatch.setenv("AUTOSP_PLAN_CACHE", str(tmp_path / "the users own"))
    runpy.run_path(os.path.join(os.path.dirname(__file__), "conftest.py"))     # as pytest runs it, first
    assert store.folder() is None


def _kept_job(rank, world, folder):
    """value_and_grad at a budget on 2 ranks, its plan kept in `folder`: (loss and grads exact, where the plan
    came from, its decisions)."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.models import batch, llama_loss, params_of, tiny_llama
    os.environ["AUTOSP_PLAN_CACHE"] = folder
    try:
        torch.manual_seed(0)
        model = tiny_llama(layers=2)
        fn, params = llama_loss(model), params_of(model)
        ids, labels = batch(2, 67, 64, seed=0, pad=3)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
        vg = autosp.value_and_grad(fn, mesh, memory_budget=0.6)
        loss, grads = vg(params, ids, labels)
        ref_loss, ref_grads = _reference(fn, params, ids, labels)
        _close(loss, ref_loss, "loss")
        for k in params:
            _close(grads[k], ref_grads[k], f"grad {k}")
        plan = vg.sharded.plan(autosp.api._differentiable(params), ids, labels)
        return plan.stored, sorted((d.name, d.action) for d in plan.decisions)
    finally:
        os.environ["AUTOSP_PLAN_CACHE"] = "off"


def test_ranks_read_the_kept_plan_and_run_it_exactly(tmp_path):
    folder = str(tmp_path / "plans")
    first = run_ranks(_kept_job, 2, folder)
    assert [s for s, _ in first] == [None, None] and len(os.listdir(folder)) == 1
    again = run_ranks(_kept_job, 2, folder)
    path = os.path.join(folder, os.listdir(folder)[0])
    assert [s for s, _ in again] == [path, path]                      # rank 0 read it and broadcast it
    assert again[0][1] == again[1][1] == first[0][1] and any(a == "recompute" for _, a in first[0][1])
