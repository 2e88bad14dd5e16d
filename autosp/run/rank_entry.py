"""A rank's entry point under `autosp train` and `autosp eval`: the fork of the launcher's zygote (zygote.py) that
runs it, or `python -m autosp.cli` where there is none.

torch.distributed.run starts this file as the rank (`python -I rank_entry.py ARGS`: the standard library alone, no
site packages, nothing imported from beside it), so that it starts, watches and stops the rank as any other. It
hands the zygote named by AUTOSP_ZYGOTE ("PID:SOCKET") its arguments, folder, environment and standard files,
passes on the signals it is sent, and ends as the fork ended: the same exit code, or killed by the same signal.
"""
import os
import pickle
import signal
import socket
import struct
import sys
import time


def _fresh():
    """The rank in this process, as the launcher ran it before zygotes: never returns."""
    env = dict(os.environ)
    env.pop("AUTOSP_ZYGOTE", None)
    os.execve(sys.executable, [sys.executable, "-u", "-m", "autosp.cli", *sys.argv[1:]], env)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _connect(pid: int, path: str):
    """A connection to the zygote once it listens (it imports first), or None where it is gone."""
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            if not _alive(pid):
                return None
            time.sleep(0.02)


def _read(s, n: int) -> bytes:
    """Up to n bytes from the socket `s`: fewer only where it closed first (zygote.py reads with it too)."""
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def main() -> None:
    pid, _, path = os.environ.get("AUTOSP_ZYGOTE", "").partition(":")
    s = _connect(int(pid), path) if pid.isdigit() and path else None
    if s is None:
        _fresh()
    env = dict(os.environ)
    env.pop("AUTOSP_ZYGOTE", None)
    data = pickle.dumps((sys.argv[1:], os.getcwd(), env))
    try:
        socket.send_fds(s, [struct.pack("!Q", len(data))], [0, 1, 2])
        s.sendall(data)
        got = _read(s, 4)
    except OSError:
        got = b""
    if len(got) < 4:                          # the zygote went before it forked this rank
        s.close()
        _fresh()
    rank = struct.unpack("!i", got)[0]

    def pass_on(sig, _frame):
        try:
            os.kill(rank, sig)
        except ProcessLookupError:
            pass
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, pass_on)
    got = _read(s, 4)
    if len(got) < 4:
        print("autosp: the process that forked this rank went before it ended (the launcher stopped?)",
              file=sys.stderr, flush=True)
        os._exit(1)
    code = struct.unpack("!i", got)[0]
    if code < 0:                              # killed: end killed by the same signal
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
