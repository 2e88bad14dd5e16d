"""DeviceMeshes of any size inside one process, for planning: nothing runs on them.

`autosp plan` and `autosp explain` trace and shard on the meta device; the sharding pass only
needs the mesh's group sizes and names. torch's `fake` process-group backend gives a world of N
ranks in this one process (collectives would be no-ops, and none is run).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist

from autosp.errors import AutospError


@contextmanager
def fake_world(size: int):
    """A process group of `size` fake ranks (this process is rank 0), torn down afterwards."""
    if dist.is_initialized():
        raise AutospError("autosp plan/explain: a process group is already initialised in this process. Fix: run "
                          "the command on its own (not under torchrun).")
    import sys

    from torch.testing._internal.distributed.fake_pg import FakeStore
    hook = sys.excepthook      # init_process_group wraps it to prefix "[rank0]: ", and destroying it does not unwrap
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def planning_mesh(sp: int, dp: int = 1):
    """The (dp, sp) mesh of a fake world (`fake_world(sp * dp)` must be active)."""
    from torch.distributed.device_mesh import init_device_mesh
    if dp == 1:
        return init_device_mesh("cpu", (sp,), mesh_dim_names=("sp",))
    return init_device_mesh("cpu", (dp, sp), mesh_dim_names=("dp", "sp"))
