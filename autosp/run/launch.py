"""Start the ranks of `autosp train` with torch's own launcher, and say clearly how a run failed.

`launch(argv)` runs torch.distributed.run in this process (its elastic agent: rendezvous, one
process per rank, `max_restarts=0`); each rank runs `python -m autosp.cli train ...` again and,
finding RANK in its environment, trains. The same happens under a user's own `torchrun`.

When a rank fails, the agent stops the others and raises ChildFailedError. A rank that fails
writes torch's error file with two more facts (`record_failure`): when, to the microsecond, and
whether its error was a collective losing its peer. The rank that failed first for a reason of
its own is then named as the cause, not the ranks that only saw it go.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
import traceback

from autosp.errors import AutospError

LAUNCHED = "AUTOSP_LAUNCHED"          # set for the ranks of our own launcher: it prints their errors

_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
              "timed out", "NCCL communicator was aborted", "Socket Timeout", "recvBytes", "sendBytes")


def _peer_lost(exc: BaseException) -> bool:
    import torch.distributed as dist
    text = f"{type(exc).__name__}: {exc}"
    return isinstance(exc, getattr(dist, "DistError", ())) or any(s in text for s in _PEER_LOST)


def _own_error(exc: BaseException) -> tuple[BaseException, str, bool, dict]:
    """(the error, its traceback, whether it only reports another rank's failure, {rank: (message,
    traceback)} of the ranks it reports). A failed checkpoint raises CheckpointException on every rank,
    carrying each failed rank's own error: the rank that failed may be stopped before it can say so."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and isinstance(failures, dict):
        told = {}
        for r, (err, frames) in failures.items():
            stack = "".join(traceback.format_list(frames or []) + traceback.format_exception_only(type(err), err))
            told[int(r)] = (f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}",
                            "Traceback (most recent call last):\n" + stack)
        rank = int(os.environ.get("RANK", "-1"))
        if rank in failures:
            return failures[rank][0], told[rank][1], False, {}
        return exc, "".join(traceback.format_exception(exc)), True, told
    return exc, "".join(traceback.format_exception(exc)), _peer_lost(exc), {}


def record_failure(exc: BaseException) -> None:
    """Write torch elastic's error file for this rank (no-op outside torch.distributed.run)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    err, stack, lost, told = _own_error(exc)
    text = str(err) if isinstance(err, AutospError) else (str(err).splitlines() or [""])[0]
    data = {"message": {"message": f"{type(err).__name__}: {text}",
                        "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time())),
                                      "autosp_time": time.time(), "autosp_peer_lost": lost,
                                      "autosp_reports": {str(r): list(v) for r, v in told.items()}}}}
    # whole or not at all: the launcher's agent reads it as soon as it sees a rank fail, and a file it finds half
    # written (empty) stopped the launcher itself with a JSONDecodeError instead of the run's exit code
    part = f"{path}.{os.getpid()}.part"
    with open(part, "w") as f:
        json.dump(data, f)
    os.replace(part, path)


def _extra(failure) -> dict:
    data = failure.error_file_data
    msg = data.get("message") if isinstance(data, dict) else None
    return msg.get("extraInfo", {}) if isinstance(msg, dict) else {}


def _what(failure) -> str:
    if _stopped(failure):
        return f"was stopped by the launcher (SIGTERM, exit code {failure.exitcode})"
    msg = failure.message
    if isinstance(msg, dict):
        msg = str(msg.get("message", msg))
    if failure.exitcode < 0:
        # a rank that recorded its error and then died tearing down (an abort in the process group's
        # shutdown after a peer failed): the recorded error is the cause
        said = "" if not msg or msg.startswith("To enable traceback") or not _extra(failure) else f": {msg.strip()}"
        return f"was killed by {failure.signal_name()} (exit code {failure.exitcode}){said}"
    if msg.startswith("To enable traceback"):
        msg = "no error recorded (the process exited without raising)"
    return f"exited with code {failure.exitcode}: {msg.strip()}"


def _stopped(failure) -> bool:
    """Stopped by the agent (SIGTERM) after another rank failed: a bystander, not a cause."""
    return failure.exitcode == -signal.SIGTERM


def _lost(failure) -> bool:
    return bool(_extra(failure).get("autosp_peer_lost", False))


def _time(failure) -> float:
    return float(_extra(failure).get("autosp_time", failure.timestamp))


def root_cause(failures: dict) -> int:
    """The global rank that failed first for a reason of its own (a signal other than the agent's
    SIGTERM, or an error that was not a collective losing its peer); else the first to fail."""
    own = [r for r, f in failures.items() if not _lost(f) and not _stopped(f)]
    pool = own or [r for r, f in failures.items() if not _stopped(f)] or list(failures)
    return min(pool, key=lambda r: _time(failures[r]))


def describe_failure(err, out: str | None, timeout: float | None = None, verb: str = "train") -> tuple[str, int]:
    """(message, exit code) for a ChildFailedError of `autosp VERB` (train, eval)."""
    from autosp.run.checkpoint import latest
    failures = err.failures
    cause = root_cause(failures)
    f = failures[cause]
    timed_out = _lost(f) and "imed out" in str(f.message)
    if timed_out:
        silent = [r for r, g in failures.items() if _stopped(g)]
        who = (f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped answering "
               "(still running, then stopped by the launcher)" if silent else "another rank stopped answering")
        lines = [f"autosp {verb}: rank {cause} timed out waiting for a collective"
                 + (f" (--timeout {timeout:g} s)" if timeout else "") + f": {who}.", f"  rank {cause} {_what(f)}"]
    elif f.exitcode == 2:                    # bad input found by the ranks (a model or budget autosp refuses)
        msg = f.message.get("message", f.message) if isinstance(f.message, dict) else f.message
        return f"autosp {verb}: error (rank {cause}): {re.sub(r'^[A-Za-z]*Error: ', '', str(msg))}", 2
    else:
        reports = {} if not _lost(f) else {int(r): v for g in failures.values()
                                           for r, v in _extra(g).get("autosp_reports", {}).items()}
        if reports:                          # the failed rank was stopped before it wrote: another rank tells
            named = min(reports)
            status = f"; rank {named} {_what(failures[named])}" if named in failures else ""
            lines = [f"autosp {verb}: rank {named} failed: {reports[named][0]}",
                     f"  (reported by rank {cause} through the checkpoint's collectives{status})"]
            stack = reports[named][1]
            cause = named if named in failures else cause
        else:
            lines = [f"autosp {verb}: rank {cause} {_what(f)}"]
            stack = _extra(f).get("py_callstack")
        if stack:
            lines.append("  its traceback:\n" + "\n".join("    " + s for s in stack.rstrip().splitlines()))
    for rank in sorted(failures):
        g = failures[rank]
        if rank == cause or (timed_out and _stopped(g)):
            continue
        why = " (it saw another rank fail)" if _lost(g) else ""
        lines.append(f"  then rank {rank} {_what(g)[:300]}{why}")
    lines.append("The other ranks were stopped.")
    if out is not None and f.exitcode != 2 and verb == "train":
        ckpt = latest(out)
        lines.append(f"Last complete checkpoint: {ckpt} (continue with --resume)." if ckpt else
                     "No complete checkpoint was written yet.")
    code = 2 if f.exitcode == 2 else (f.exitcode if f.exitcode > 0 else 128 - f.exitcode)
    return "\n".join(lines), code


def launcher_args(a, argv: list[str], forked: bool = False) -> list[str]:
    """torch.distributed.run's command line for `autosp train` with these arguments; `forked`: each rank's entry
    point is rank_entry.py, which has the launcher's zygote fork the rank (zygote.py)."""
    world = a.step.world
    nnodes = a.nnodes
    nproc = a.nproc_per_node
    if nproc is None:
        nproc = world // int(str(nnodes).split(":")[-1])
    args = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--max-restarts", "0",
            "--monitor-interval", "0.1"]
    for flag in ("node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "master_addr",
                 "master_port"):
        value = getattr(a, flag)
        if value is not None:
            args += ["--" + flag.replace("_", "-"), str(value)]
    if a.log_dir:
        args += ["--log-dir", a.log_dir]
    if forked:
        from autosp.run.zygote import ENTRY
        return args + ["--no-python", sys.executable, "-I", ENTRY] + argv
    return args + ["-m", "autosp.cli"] + argv


def rank_threads(ranks: int) -> int:
    """The intra-op threads each of `ranks` CPU ranks on this machine runs with: OMP_NUM_THREADS if set, else the
    cores shared out (what `launch` sets). A CPU plan prices ATen's attention scratch per thread, so the planner
    prices it at this count, not at its own process's."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


def rank_env(a) -> dict:
    """What the launcher adds to its ranks' environment: LAUNCHED, and OMP_NUM_THREADS where it is not set."""
    env = {LAUNCHED: "1"}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(rank_threads(a.nproc_per_node or a.step.world))
    return env


def start_zygote(a) -> None:
    """The zygote of the ranks a launch of `a` (a.step known) will start, begun now (a.zygote), so that it imports
    while the launcher checks, tokenizes and plans; launch() takes it, and close_zygote(a) ends one not taken. CPU
    ranks only: they share the host's cores, where each fresh interpreter's imports cost the others time (a GPU
    node's ranks import side by side on cores of their own, and a fork must never carry a started GPU driver).
    A zygote this process kept from an earlier launch (`cli.main(argv)` called again in one process: KEPT) is taken
    where it was started for a model of the same code in the same environment."""
    from autosp.run.zygote import Zygote
    a.zygote = None
    if a.step.device != "cpu":
        return
    env = rank_env(a)
    if not getattr(a, "keep_zygote", False):       # a one-shot launch: nothing kept to take, nothing to key
        a.zygote = Zygote.start(a.step.model, env)
        return
    a.zygote_key = (_model_code(a.step.model), tuple(sorted({**os.environ, **env}.items())))
    kept = KEPT.pop(a.zygote_key, None)
    if kept is not None and kept.alive():
        a.zygote = kept
        return
    if kept is not None:
        kept.close()
    a.zygote = Zygote.start(a.step.model, env)


def _model_code(model: str) -> str:
    """The zygote's preload for `model` (zygote.model_code), or its name where that cannot be read here (the zygote
    then fails to preload it as the rank would fail)."""
    from autosp.run.zygote import model_code
    try:
        return model_code(model)
    except Exception:  # noqa: BLE001 - see above
        return model


# A process that launches again (cli.main(argv) called in-process: a notebook, a sweep, the test suite) keeps its
# zygotes for the next launch of a model of the same code in the same environment: each saves that launch the ~8 s
# of CPU a zygote spends importing (bench/RESULTS.md, "The suite's time"). (the model's code, the environment) ->
# its Zygote, the latest last; at most KEEP of them (each holds torch, transformers and scipy imported).
KEPT: dict[tuple, object] = {}
KEEP = 2


def close_zygote(a) -> None:
    """End the zygote of `a`'s launch, or, where `a.keep_zygote` (cli.main called with its arguments), keep it for
    the next launch in this process (KEPT; close_kept ends them)."""
    zygote, a.zygote = getattr(a, "zygote", None), None
    if zygote is None:
        return
    if not getattr(a, "keep_zygote", False) or not zygote.alive():
        zygote.close()
        return
    KEPT.pop(a.zygote_key, None)
    KEPT[a.zygote_key] = zygote
    while len(KEPT) > KEEP:
        KEPT.pop(next(iter(KEPT))).close()
    import atexit
    atexit.unregister(close_kept)
    atexit.register(close_kept)


def close_kept() -> None:
    """End the zygotes this process kept (they would leave with it anyway: each watches its launcher)."""
    while KEPT:
        KEPT.popitem()[1].close()


def launch(a, argv: list[str]) -> int:
    """Run `autosp train` on its ranks; the exit code of the whole run."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run
    if not a.verbose:
        for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if not hasattr(a, "zygote"):
        start_zygote(a)
    os.environ.update(rank_env(a))
    from autosp.run.zygote import ENV
    zygote = a.zygote
    targs = get_args_parser().parse_args(launcher_args(a, argv, forked=zygote is not None))
    if zygote is not None:
        os.environ[ENV] = zygote.env
    try:
        run(targs)
    except ChildFailedError as err:
        msg, code = describe_failure(err, a.out, a.timeout, a.verb)
        print(msg, file=sys.stderr, flush=True)
        return code
    except SignalException as sig:
        print(f"autosp {a.verb}: stopped by {signal.Signals(sig.sigval).name}; the ranks were stopped.",
              file=sys.stderr, flush=True)
        return 128 + int(sig.sigval)
    finally:
        os.environ.pop(ENV, None)
        close_zygote(a)
    return 0
