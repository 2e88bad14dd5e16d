"""A launch's ranks are forks of one process that imported what a rank imports (autosp/run/zygote.py): each rank's
entry (rank_entry.py, what torch.distributed.run starts) ends as its fork ended, passes on the signals it is sent,
takes its fork with it when it is killed outright, and runs the rank itself where there is no zygote. The runs
through torch.distributed.run (tests/test_cli.py: a rank killed, an interrupted save, every launch) hold the rest."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from autosp.run.zygote import ENTRY, ENV, Zygote, usable
from tests.test_cli import CONFIG, ROOT

pytestmark = pytest.mark.skipif(not usable(), reason="ranks are forked on Linux only")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _entry(argv, zygote, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("AUTOSP_FAULT", ENV, "RANK", "WORLD_SIZE")}
    full.update(PYTHONPATH=ROOT, **env)
    if zygote is not None:
        full[ENV] = zygote.env
    return subprocess.Popen([sys.executable, "-I", ENTRY, *argv], cwd=ROOT, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(run) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait(cond, what: str, timeout: float = 120.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.05)


def test_a_forked_rank_ends_as_a_fresh_one_and_the_signals_its_entry_gets_reach_it(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(CONFIG))
    zygote = Zygote.start(str(tmp_path / "model"), {"OMP_NUM_THREADS": "1"})
    try:
        # a rank that refuses its input: the same exit code and message as `python -m autosp.cli` in its place
        bad = ["export", str(tmp_path / "no-run"), "--out", str(tmp_path / "hf")]
        forked = _entry(bad, zygote)
        out, err = forked.communicate(timeout=240)
        fresh = subprocess.run([sys.executable, "-m", "autosp.cli", *bad], cwd=ROOT, capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": ROOT}, timeout=240)
        assert forked.returncode == fresh.returncode == 2, (err, fresh.stderr)
        assert err == fresh.stderr and out == fresh.stdout and "Fix:" in err, (err, fresh.stderr)

        # a rank of a 1-rank run that hangs at its second step: a fork of the zygote, which SIGTERM sent to its
        # entry stops (the entry ends by SIGTERM), and which SIGKILL sent to its entry takes with it
        for sig in (signal.SIGTERM, signal.SIGKILL):
            run = tmp_path / f"run-{sig.name}"
            entry = _entry(["train", "--model", str(tmp_path / "model"), "--seq-len", "64", "--batch", "1",
                            "--steps", "3", "--out", str(run)], zygote, AUTOSP_FAULT="0:2:hang", AUTOSP_LAUNCHED="1",
                           RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(_port()), OMP_NUM_THREADS="1")
            _wait(lambda: _rows(run) or entry.poll() is not None, "the first step's metrics")
            assert entry.poll() is None, entry.communicate()
            assert len(_children(zygote.proc.pid)) == 1             # the rank is the zygote's fork
            entry.send_signal(sig)
            entry.communicate(timeout=60)
            assert entry.returncode == -sig, (sig, entry.returncode)
            # it hung where its entry's environment (not the zygote's) said
            assert _rows(run) == 1
            _wait(lambda: not _children(zygote.proc.pid), f"the fork outlived its entry ({sig.name})", 30)
    finally:
        zygote.close()
    assert zygote.proc.poll() is not None and not os.path.exists(zygote.folder)


def test_without_its_zygote_an_entry_runs_the_rank_itself(tmp_path):
    """No zygote (AUTOSP_FORK_RANKS=0, or one gone before the entry asked): `python -m autosp.cli` in its place."""
    bad = ["export", str(tmp_path / "no-run"), "--out", str(tmp_path / "hf")]
    gone = Zygote.start(None, {})
    gone.close()
    for zygote in (None, gone):
        entry = _entry(bad, zygote)
        _, err = entry.communicate(timeout=240)
        assert entry.returncode == 2 and "Fix:" in err, err


def test_a_launcher_killed_outright_leaves_neither_its_zygote_nor_its_socket():
    """The launcher closes its zygote; one SIGKILLed cannot: the zygote sees it gone, and its socket and folder go
    with it (a dead launcher's autosp-zygote-* folders piled up in /tmp)."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from autosp.run.zygote import Zygote; z = Zygote.start(None, {}); "
         "print(z.proc.pid, z.path, flush=True); time.sleep(600)"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, text=True)
    try:
        pid, path = launcher.stdout.readline().split()
        _wait(lambda: os.path.exists(path), "the zygote listens")
    finally:
        launcher.kill()
        launcher.wait()

    def gone() -> bool:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:      # a zombie (reaped by init soon) has ended too
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True
    _wait(gone, "the zygote ends with its launcher", timeout=30)
    _wait(lambda: not os.path.exists(os.path.dirname(path)), "its folder is removed", timeout=10)


def test_a_launcher_that_launches_again_keeps_its_latest_zygotes_and_a_one_shot_closes_its(monkeypatch, tmp_path):
    """cli.main(argv) called in-process keeps a launch's zygote for the next launch of a model of the same code in the
    same environment (launch.KEPT; tests/test_cli.py holds a resume to the zygote its run kept): at most KEEP, the
    latest; one that has died is not taken or kept; `python -m autosp` (keep_zygote false) closes its own."""
    from types import SimpleNamespace

    from autosp.run import launch

    class Fake:
        def __init__(self, model, env):
            self.model, self.live, self.closed = model, True, False

        def alive(self):
            return self.live

        def close(self):
            self.live, self.closed = False, True

    started = []
    monkeypatch.setattr(Zygote, "start", classmethod(lambda cls, model, env: started.append(Fake(model, env))
                                                     or started[-1]))
    monkeypatch.setattr(launch, "KEPT", {})

    def run(model, keep=True, **env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        a = SimpleNamespace(step=SimpleNamespace(model=model, device="cpu", world=2), nproc_per_node=None,
                            keep_zygote=keep)
        launch.start_zygote(a)
        z = a.zygote
        launch.close_zygote(a)
        return z

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))      # a Llama of other shapes: the same code as tiny's
    first = run("tiny")
    assert run("tiny") is first and len(started) == 1           # the same model and environment: kept and taken
    assert run(str(tmp_path)) is first and len(started) == 1    # a model of the same code
    other_env = run("tiny", AUTOSP_TEST_ZYGOTE="1")                 # another environment: a zygote of its own
    assert other_env is not first and len(started) == 2 and len(launch.KEPT) == 2
    third = run("tiny", AUTOSP_TEST_ZYGOTE="2")                     # a third: the oldest kept is closed
    assert first.closed and not other_env.closed and set(launch.KEPT.values()) == {other_env, third}
    third.live = False          # died while kept: not taken (its environment is still set), a new one started
    fresh = run("tiny")
    assert fresh is not third and len(started) == 4 and third not in launch.KEPT.values()
    one_shot = run("tiny", keep=False, AUTOSP_TEST_ZYGOTE="3")
    assert one_shot.closed and one_shot not in launch.KEPT.values()
    launch.close_kept()
    assert not launch.KEPT and all(z.closed for z in started)
