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


# ---------------------------------------------------------------- `autosp plan`'s whole answer, kept

TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}


@pytest.fixture
def answers(tmp_path, monkeypatch):
    """Answers (and the plans under them) kept in a folder of the test's own; no fake world (the command makes its
    own)."""
    folder = tmp_path / "plans"
    monkeypatch.setenv("AUTOSP_PLAN_CACHE", str(folder))
    monkeypatch.setattr(store, "_WARNED", False)
    return folder


def _model(folder, **changed) -> str:
    import json
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(TINY, **changed)))
    return str(folder)


def _answer_key(*argv: str) -> str:
    from autosp.cli import parser
    from autosp.run.answer import _question
    from autosp.run.config import step_of
    a = parser().parse_args(["plan", *argv])
    return store.answer_key(*_question(step_of(a, "plan"), a.granularity))


def test_the_answer_key_is_what_the_answer_depends_on(tmp_path, monkeypatch):
    """One argument, one config value, one byte of autosp's sources, the environment the planner reads: each
    changes the key (a miss: planned afresh); what the answer does not read (where the cache is) does not."""
    model = _model(tmp_path / "m")
    flags = ["--model", model, "--sp", "2", "--memory", "4MiB"]
    base = _answer_key(*flags)
    assert _answer_key(*flags) == base
    monkeypatch.setenv("AUTOSP_PLAN_CACHE", str(tmp_path / "elsewhere"))
    assert _answer_key(*flags) == base
    others = [_answer_key(*flags[:3], "4", *flags[4:]), _answer_key(*flags[:5], "5MiB"),
              _answer_key(*flags, "--granularity", "256"), _answer_key(*flags, "--seq-len", "1024"),
              _answer_key(*flags, "--offload"), _answer_key(*flags, "--no-tile"), _answer_key(*flags, "--gpu", "h100"),
              _answer_key(*flags, "--gpu", "h200"), _answer_key(*flags, "--precision", "bf16"),
              _answer_key("--model", "tiny", *flags[2:])]
    _model(tmp_path / "m", vocab_size=128)                            # one config value, same path
    others.append(_answer_key(*flags))
    _model(tmp_path / "m")
    assert _answer_key(*flags) == base
    monkeypatch.setenv("OMP_NUM_THREADS", "7")                         # the threads a CPU plan is priced at
    others.append(_answer_key(*flags))
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("AUTOSP_MASK_FUNCTIONS", "0")                   # the sharding pass reads it
    others.append(_answer_key(*flags))
    monkeypatch.delenv("AUTOSP_MASK_FUNCTIONS")
    import importlib.metadata
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0" if name == "transformers" else real(name))
    others.append(_answer_key(*flags))                                 # it builds and traces the model
    monkeypatch.setattr(importlib.metadata, "version", real)
    import autosp.sources
    monkeypatch.setattr(autosp.sources, "digest", lambda: "other sources")
    others.append(_answer_key(*flags))
    assert len(set(others)) == len(others) and base not in others


def test_the_sources_digest_changes_with_one_byte(tmp_path):
    """autosp.sources.digest, on a copy of the package's sources: one byte of one file changes it."""
    import importlib.util
    import shutil

    import autosp.sources
    root = os.path.dirname(autosp.sources.__file__)
    copy = tmp_path / "autosp"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def digest() -> str:
        spec = importlib.util.spec_from_file_location("sources_copy", copy / "sources.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)                                # its own cache: digested afresh
        return module.digest()
    first = digest()
    assert first == digest() == autosp.sources.digest()
    target = copy / "run" / "answer.py"
    text = target.read_bytes()
    target.write_bytes(text.replace(b"Planned in", b"Planned in ", 1))
    assert digest() != first


def test_a_repeated_plan_is_answered_from_the_cache_byte_for_byte(answers, tmp_path, monkeypatch, capsys):
    """`autosp plan` asked again prints what it printed (stdout byte for byte, its exit code), traces and
    differentiates nothing, and says on stderr where the answer came from."""
    import autosp.passes.autodiff
    import autosp.run.answer
    from autosp.cli import main
    argv = ["plan", "--model", _model(tmp_path / "m"), "--sp", "2", "--seq-len", "1024", "--memory", "4MiB"]
    assert main(argv) == 0
    cold = capsys.readouterr()
    assert "train it:" in cold.out and "plan cache" not in cold.err
    entries = set(answers.glob("*.plan"))

    def refuse(*args, **kwargs):
        raise AssertionError("traced or differentiated again: the kept answer was not read")
    monkeypatch.setattr(autosp.run.answer, "_tracer", refuse)
    monkeypatch.setattr(autosp.passes.autodiff, "differentiate", refuse)
    assert main(argv) == 0
    warm = capsys.readouterr()
    assert warm.out == cold.out
    (path,) = [p for p in entries if store.load(p.stem)[0] == "answer"]
    assert f"read from {path} (AUTOSP_PLAN_CACHE=off plans afresh)" in warm.err
    assert set(answers.glob("*.plan")) == entries


def test_an_answer_is_kept_with_its_verdict_unless_a_mip_was_cut_short(answers, monkeypatch):
    """A refusal is kept as refused (exit code 2 again); an answer of which a MIP, here or in a forked helper
    (plan._both), ended by its time limit is not kept."""
    import autosp.run.answer as answer
    from autosp.remat import solve
    from autosp.run.config import Step
    from autosp.run.plan import _both

    class Refused:
        fits = False

        def text(self):
            return "no"
    asked = []
    monkeypatch.setattr(answer, "at_length", lambda step: asked.append(step) or Refused())
    step = Step("tiny", sp=2, seq_len=4096, memory="1MiB")
    assert answer.answer(step) == answer.Answer("no", False)
    said = answer.answer(step)
    assert len(asked) == 1 and not said.ok and said.text == "no" and said.stored is not None

    class Report:
        text, ok = "the longest", True
    monkeypatch.setattr(answer, "longest", lambda step, granularity: asked.append(granularity) or Report())
    assert answer.answer(step.with_length(None), 512) == answer.Answer("the longest", True)
    assert answer.answer(step.with_length(None), 512).stored is not None and asked[1:] == [512]
    assert answer.answer(step.with_length(None), 256).stored is None and asked[1:] == [512, 256]   # another question

    def cut_short():
        solve._LIMITED[0] += 1                      # as a MIP ended by its time limit counts itself
        return 2
    before = solve.time_limits()
    assert _both(lambda: 1, lambda: 2) == (1, 2) and solve.time_limits() == before
    assert _both(lambda: 1, cut_short) == (1, 2) and solve.time_limits() == before + 1     # the child's, counted
    monkeypatch.setattr(answer, "at_length", lambda step: _both(Refused, cut_short)[0])
    other = step.with_length(8192)
    assert answer.answer(other).stored is None and answer.answer(other).stored is None      # planned each time


def test_a_program_simulated_again_at_another_thread_count_prices_cpu_attention_at_it():
    """The memory model reads each equation's outputs, aliases and scratch function once (liveness._static: the
    planner simulates many programs made of the same equations), but not the scratch itself: ATen's CPU
    attention's is per thread, and the ranks plan at their own thread count."""
    from autosp.passes.schedule import schedule_program
    from autosp.remat import plan_step, simulate_step
    _, program, _, _ = plan_step(_local(), None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = simulate_step(program).backward.during
        torch.set_num_threads(3)
        three = simulate_step(program).backward.during
    finally:
        torch.set_num_threads(threads)
    wider = {schedule_program(program).backward.eqns[i].op.name for i, (a, b) in enumerate(zip(one, three)) if b != a}
    assert wider == {"_scaled_dot_product_flash_attention_for_cpu_backward.default"}
    assert all(b >= a for a, b in zip(one, three))
