"""Run a function on N real processes over gloo; failures come back with their traceback."""
from __future__ import annotations

import atexit
import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _leave(queue)


def _leave(*boxes) -> None:
    """End a rank's process once what it put is sent: the interpreter's teardown of torch and transformers costs
    1.5-2 s of CPU in each process (autosp.cli._leave)."""
    for box in boxes:
        box.close()
        box.join_thread()
    os._exit(0)


_POOLS: dict[int, "RankPool"] = {}


def run_ranks(fn, world: int, *args, timeout: float = 300, fresh: bool = False):
    """fn(rank, world, *args) on `world` gloo processes; returns the results by rank or raises.

    The processes are the session's pool for that world size (RankPool, started on first use and
    kept: a spawn and `import autosp` cost 3.5 s at 2 ranks and 8.8 s at 4 on the 2-core CI machine,
    per call). A failed or timed-out job spends its pool; the next call starts a fresh one.
    fresh=True runs on new processes instead, for tests that read what a process holds besides the step (the host
    pool's growth, inductor's in-process caches); a step's peak (autosp.memory.peak_bytes: its own allocation
    events) is the same in a pool's process."""
    if fresh:
        return _run_fresh(fn, world, *args, timeout=timeout)
    if world not in _POOLS:
        _POOLS[world] = RankPool(world)
    try:
        return _POOLS[world].run(fn, *args, timeout=timeout)
    except AssertionError:
        _POOLS.pop(world, None)
        raise


@atexit.register
def close_pools() -> None:
    """Stop the session's pools (registered after multiprocessing's own exit handler, so it runs first)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def _run_fresh(fn, world: int, *args, timeout: float = 300):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, out = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = out
            else:
                errors.append(f"rank {rank}:\n{out}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def _pool_worker(rank, world, port, inbox, outbox, parent):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        while True:
            try:
                job = inbox.get(timeout=5)
            except queue.Empty:         # a pytest worker that ends without its exit handlers leaves no one to ask
                if os.getppid() != parent:
                    break
                continue
            if job is None:
                break
            fn, args = job
            try:
                outbox.put((rank, "ok", fn(rank, world, *args)))
            except BaseException:  # noqa: BLE001 - report everything to the parent
                outbox.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()
        _leave(outbox)


class RankPool:
    """`world` gloo processes kept alive across calls: `pool.run(fn, *args)` is run_ranks without
    the start-up (one process spawn and import per rank), for tests that run many small jobs."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world, self.outbox = world, ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        port = _free_port()
        args = [(r, world, port, self.inboxes[r], self.outbox, os.getpid()) for r in range(world)]
        self.procs = [ctx.Process(target=_pool_worker, args=a) for a in args]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 300):
        for box in self.inboxes:
            box.put((fn, args))
        results, errors = {}, []
        try:
            for _ in range(self.world):
                rank, status, out = self.outbox.get(timeout=timeout)
                if status != "ok":
                    errors.append(f"rank {rank}:\n{out}")
                    break
                results[rank] = out
        except queue.Empty:
            errors.append(f"no answer from ranks {sorted(set(range(self.world)) - set(results))} in {timeout} s")
        if errors:                      # the other ranks may wait in a collective: the pool is spent
            self.close(kill=True)
            raise AssertionError("\n".join(errors))
        return [results[r] for r in range(self.world)]

    def close(self, kill: bool = False):
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 30)
            if p.is_alive():
                p.kill()
