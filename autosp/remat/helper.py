"""A verdict's next end, searched on the core its round's other verdict leaves idle.

`autosp plan` checks its answer with verdicts two at a time, one per process (run/plan.py's `_both`): a length
that fits usually stops at the first end of its least-peak search (the most tiled step, the backend's attention
backward), and the length a granule on, refused, searches every end (the untiled step; autosp's attention backward
on a GPU) while the first process waits. A verdict's search therefore forks a helper for its next end as it starts
(`Helper`): the helper waits until the other process has finished (PEER_IDLE's path exists), says it has started,
and searches that end. The search takes the helper's answer when it reaches that end, waiting for it where it has
started; where it has not (the core is still busy), it stops the helper and searches the end itself, as without
one. The ends searched and their answers are the same either way: only which process searches one changes.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time

PEER_IDLE: list = [None]    # a path that exists once a core is idle for this process's helper; None: no helper


@contextlib.contextmanager
def idle_core():
    """Within: the other core is idle now (a verdict asked alone): its search's helper starts at once."""
    import tempfile
    fd, path = tempfile.mkstemp(prefix="autosp-idle-")
    os.close(fd)
    before, PEER_IDLE[0] = PEER_IDLE[0], path
    try:
        yield
    finally:
        PEER_IDLE[0] = before
        os.unlink(path)


class Helper:
    """work() (an end's search: a picklable result) in a forked process that starts once PEER_IDLE's path exists.
    `end` names what it searches, for the search to recognise it."""

    def __init__(self, end, work, idle: str):
        self.end = end
        parent = os.getpid()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                                   # the helper: wait for the idle core, search, send, leave
            try:
                os.close(r)
                PEER_IDLE[0] = None
                while not os.path.exists(idle):
                    if os.getppid() != parent:         # the search is gone: nothing to help
                        os._exit(0)
                    time.sleep(0.02)
                os.write(w, b"s")
            except BaseException:  # noqa: BLE001
                os._exit(1)
            child_answers(w, work)
        os.close(w)
        self.pid, self.fd = pid, r

    def take(self):
        """The helper's result, waited for where it has started; None where it had not (it is stopped) or failed."""
        from autosp.remat import solve
        os.set_blocking(self.fd, False)
        try:
            began = os.read(self.fd, 1)
        except BlockingIOError:
            began = b""
        if began != b"s":
            self.stop()
            return None
        os.set_blocking(self.fd, True)
        with os.fdopen(self.fd, "rb") as f:
            data = f.read()
        self.fd = None
        os.waitpid(self.pid, 0)
        self.pid = None
        if not data:
            return None
        status, out, limited = pickle.loads(data)
        solve._LIMITED[0] += limited          # its MIPs cut short by their time limit are this search's
        return out if status == "ok" else None

    def stop(self) -> None:
        """End the helper, whatever it is doing (an end the search did not reach: it stopped before it)."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
            self.pid = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def child_answers(w: int, work) -> None:
    """In a forked child: work() sent down the pipe `w` as ('ok', result) or ('error', the exception), with how many
    MIPs their time limit ended meanwhile (solve.time_limits: the parent counts them as its own); then the child
    leaves without the interpreter's cleanup. Never returns."""
    from autosp.remat.solve import time_limits
    code = 0
    try:
        limited = time_limits()
        try:
            out = ("ok", work())
        except BaseException as exc:  # noqa: BLE001 - sent to the parent
            out = ("error", exc)
        data = pickle.dumps(out + (time_limits() - limited,))
        with os.fdopen(w, "wb") as f:
            f.write(data)
    except BaseException:  # noqa: BLE001 - the parent reads nothing: the child died
        code = 1
    finally:
        os._exit(code)
