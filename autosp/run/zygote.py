"""A launch's ranks forked from one process that has imported what a rank imports, once.

A CPU rank of `autosp train` or `autosp eval` (launch.start_zygote: GPU ranks import on cores of their own) was a
fresh interpreter that spent most of a short run importing (torch 2.7 s, transformers and a model's code 3-5 s,
autosp, DCP, scipy: ~9 s of CPU each on this machine's cores, before its first step). The launcher therefore
starts one process that imports all of it before any tensor op runs (no OpenMP pool: a fork of a process whose pool
has run hangs in it; no GPU driver: one that has started it is not forked from, see _forkable), and each rank is a
fork of it:

    zygote = Zygote.start(model)          # the launcher, before torch.distributed.run starts the ranks
    os.environ[ENV] = zygote.env          # each rank's entry point is rank_entry.py, which asks it for a fork
    ...
    zygote.close()

torch.distributed.run still starts, watches and stops every rank as before: what it starts is rank_entry.py, a
stdlib-only script (`python -I`: ~20 ms) that sends the zygote its arguments, working folder, environment and its
stdin, stdout and stderr (SCM_RIGHTS), so that the fork is that rank as a fresh `python -u -m autosp.cli` would have
been (the same environment, files and signals as the agent gave it). The entry waits for the fork's end and ends
as it did: its exit code, or the same signal (a rank killed with SIGKILL is reported as killed); the signals the
agent sends it (SIGTERM, SIGINT, ...) are passed on to the fork, and an entry killed outright takes its fork with
it (the zygote sees its connection close). Where the zygote is not up (no fork, AUTOSP_FORK_RANKS=0, it failed to
start or died), the entry runs `python -m autosp.cli` in its own place (exec), as before.

The zygote is started with the ranks' environment but for what torch.distributed.run adds per rank (RANK,
MASTER_ADDR, ...: read only once a rank runs), OMP_NUM_THREADS included (the OpenMP runtime reads it as torch is
imported), and with `-u` as the agent starts a rank. It leaves when the launcher closes it or is gone. A launcher
that launches again in its own process (`cli.main(argv)`: a notebook, a sweep, the test suite) keeps it for the next
launch of a model of the same code in the same environment (launch.KEPT): a fork is unchanged by the forks before it.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile

ENV = "AUTOSP_ZYGOTE"                  # the socket a rank's entry asks for its fork (set by the launcher)
OFF = "AUTOSP_FORK_RANKS"              # "0": every rank a fresh interpreter (python -m autosp.cli)
ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_entry.py")
# what every rank imports, whatever its model: imported once in the zygote
PRELOAD = ("autosp.cli", "autosp.run.train", "autosp.run.evaluate", "autosp.run.checkpoint", "autosp.remat",
           "torch.distributed.checkpoint", "torch.distributed.tensor", "scipy.optimize", "transformers")


def usable() -> bool:
    """Ranks can be forked here: Linux (a fork dies with its zygote: PR_SET_PDEATHSIG), and not turned off."""
    return os.environ.get(OFF, "1") != "0" and sys.platform.startswith("linux") and hasattr(socket, "send_fds")


class Zygote:
    """The launcher's handle on its zygote process."""

    def __init__(self, proc, folder: str):
        self.proc, self.folder = proc, folder
        self.path = os.path.join(folder, "zygote")

    @classmethod
    def start(cls, model: str | None = None, env: dict | None = None) -> "Zygote | None":
        """A zygote importing PRELOAD and the code of `model` (a preset or a config's path), in this environment
        updated with `env` (what the launcher gives its ranks), or None where ranks cannot be forked here."""
        if not usable():
            return None
        folder = tempfile.mkdtemp(prefix="autosp-zygote-")
        args = [sys.executable, "-u", "-m", "autosp.run.zygote", os.path.join(folder, "zygote"), str(os.getpid())]
        try:
            proc = subprocess.Popen(args + ([model] if model else []), stdin=subprocess.DEVNULL,
                                    env={**os.environ, **(env or {})})
        except OSError:
            os.rmdir(folder)
            return None
        return cls(proc, folder)

    @property
    def env(self) -> str:
        """ENV's value for the entries: the zygote's pid (an entry whose zygote is gone runs fresh) and socket."""
        return f"{self.proc.pid}:{self.path}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        import shutil
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _preload(model: str | None) -> None:
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the rank imports it itself, and fails there as it would have
            pass
    try:                                       # the loss curve's plotting (metrics.plot_loss: Agg, then pyplot), which
        import matplotlib                      # the first rank imports at the end of a run: ~1 s of its CPU
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except Exception:  # noqa: BLE001 - as above (matplotlib is the train extra's)
        pass
    if model:
        try:                                   # the model's own code (transformers imports each model's lazily)
            model_code(model)
        except Exception:  # noqa: BLE001 - as above
            pass


def model_code(model: str) -> str:
    """The module of `model`'s code (a preset or a config's path), imported: what a zygote preloads for it."""
    from transformers import AutoModelForCausalLM

    from autosp.run.models import model_config
    return AutoModelForCausalLM._model_mapping[type(model_config(model).config)].__module__


def serve(path: str, launcher: int, model: str | None = None) -> None:
    """The zygote: import, then fork a rank for each entry that asks, until the launcher is gone. Where the imports
    started a GPU's driver (a fork could not use it), it leaves at once: each entry then runs its rank itself."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"    # torch.cuda.is_available() without starting the driver
    _preload(model)
    if not _forkable():
        return
    import gc
    sys.stdout.flush()
    sys.stderr.flush()
    gc.collect()
    gc.freeze()                                # the forks' collections leave what they inherit unscanned
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # ^C stops the launcher, which closes this
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    try:
        _serve(listener, launcher)
    finally:                                   # a launcher killed outright never closes it: the socket and its
        listener.close()                       # folder (the launcher's, empty now) go with the zygote
        for remove, leftover in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
            try:
                remove(leftover)
            except OSError:
                pass


def _serve(listener, launcher: int) -> None:
    listener.listen(64)
    ranks: dict[int, socket.socket] = {}       # a fork's pid -> its entry's connection
    while os.getppid() == launcher:
        ready, _, _ = select.select([listener, *ranks.values()], [], [], 0.05)
        for conn in ready:
            if conn is listener:
                entry, _ = listener.accept()
                pid = _fork(entry, listener, ranks)
                if pid is not None:
                    ranks[pid] = entry
            else:                              # an entry that sends nothing more has gone: its fork goes with it
                pid = next(p for p, c in ranks.items() if c is conn)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while ranks:                           # forks that have ended: their entries end as they did
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = ranks.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    conn.sendall(struct.pack("!i", code))
                except OSError:
                    pass
                conn.close()
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _forkable() -> bool:
    """No GPU runtime started in this process: CUDA's driver is loaded by its first use (libcuda in the process's
    maps); ROCm's runtime is linked into torch, so a ROCm build is never forked from."""
    import torch
    if getattr(torch.version, "hip", None):
        return False
    try:
        with open("/proc/self/maps") as f:
            return "libcuda.so" not in f.read()
    except OSError:
        return False


def _recv(conn) -> tuple[list, str, dict, list[int]] | None:
    """An entry's (argv, cwd, environ, [stdin, stdout, stderr]), or None where it sent less."""
    from autosp.run.rank_entry import _read
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    n = struct.unpack("!Q", head)[0] if len(head) == 8 else None
    data = _read(conn, n) if n is not None and len(fds) == 3 else b""
    if n is None or len(data) < n:
        for fd in fds:                         # an entry that sent less: the files it sent are not kept open
            os.close(fd)
        return None
    argv, cwd, env = pickle.loads(data)
    return argv, cwd, env, fds


def _fork(entry, listener, ranks) -> int | None:
    got = _recv(entry)
    if got is None:
        entry.close()
        return None
    argv, cwd, env, fds = got
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            listener.close()
            for conn in (entry, *ranks.values()):
                conn.close()
            _become(zygote, argv, cwd, env, fds)
        finally:
            os._exit(1)
    for fd in fds:
        os.close(fd)
    entry.sendall(struct.pack("!i", pid))
    return pid


def _become(zygote: int, argv: list, cwd: str, env: dict, fds: list[int]) -> None:
    """In the fork: the rank `python -u -m autosp.cli ARGV` would have been, in the entry's folder, environment
    and files. Never returns."""
    code = 1
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))    # PR_SET_PDEATHSIG: gone with the zygote
        if os.getppid() != zygote:
            os._exit(1)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGINT, signal.default_int_handler)     # as a fresh interpreter has it
        import random

        import numpy as np
        random.seed()                          # a fresh interpreter's are seeded apart; the zygote's are shared
        np.random.seed()
        sys.argv = [os.path.join(os.path.dirname(os.path.dirname(ENTRY)), "cli.py"), *argv]   # as `-m autosp.cli`
        from autosp.cli import main
        code = main()                          # leaves the process itself (cli._leave) once it has answered
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as the interpreter ends on an uncaught exception
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
