"""Model state sharded over every rank: parameters laid out as FSDP2 lays them out.

    model = autosp.shard_params(model, mesh)          # in place, as fully_shard does; returns the model
    params = autosp.shard_params(dict_of_tensors, mesh)

Each parameter becomes a `torch.distributed.tensor.DTensor` split on its first dim over all ranks of
the mesh (dp x sp flattened, dp outer; a mesh with only sp splits over sp): `Shard(0)`, uneven
first dims as FSDP2 splits them (ceil(n / ranks) rows per rank, the last ranks shorter or empty).
autosp traces the step with the parameters' global shapes; the sharded program gathers each one
(`autosp::all_gather_param`) before its first use and reduce-scatters its gradient, which comes
back as a DTensor with the parameter's placements, so torch's optimizers, clip_grad_norm_ and
torch.distributed.checkpoint work on the shards unchanged.

Mixed precision as FSDP2's MixedPrecisionPolicy: `param_dtype` is what the gather moves and the
step computes in (the shards stay in their own dtype, the master weights); `reduce_dtype` is what
the gradient is summed in (default: the shard's dtype, fp32 for fp32 masters).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from autosp.errors import AutospError

_MP_ATTR = "_autosp_mixed_precision"        # (param_dtype, reduce_dtype) on a sharded parameter


@dataclass(frozen=True, slots=True)
class ParamShard:
    """How one parameter is split: its first dim over `group`, `chunk` rows per rank (padded)."""
    rows: int                       # the global first dim
    chunk: int                      # rows per rank: ceil(rows / ranks)
    ranks: int
    group: str                      # the process group the first dim is split over
    sync: tuple[str, ...]           # groups the gradient is then summed over (Replicate mesh dims)
    master: torch.dtype             # the shard's dtype
    dtype: torch.dtype              # the gathered (compute) dtype
    reduce_dtype: torch.dtype       # the gradient's reduction dtype

    def describe(self) -> str:
        return (f"Shard(0) over {self.ranks} ranks, {self.chunk} of {self.rows} rows each"
                + (f", gathered as {self.dtype}" if self.dtype != self.master else ""))


def is_dtensor(x) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(x, DTensor)


def world_mesh(mesh):
    """The 1-D mesh over every rank of an autosp mesh (dp outer, sp inner), as FSDP2 shards over."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        return mesh
    flatten = getattr(mesh[names], "_flatten", None)
    if flatten is not None:
        return flatten("_".join(names))
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh(mesh.device_type, mesh.mesh.flatten(), mesh_dim_names=("_".join(names),))


def shard_params(params, mesh, *, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None):
    """`params` (an nn.Module, in place, or a dict of tensors) with every parameter a DTensor split
    on dim 0 over all ranks of `mesh`; see the module docstring. Every rank passes the same values."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    flat = world_mesh(mesh)
    n, rank = flat.size(), flat.get_local_rank()

    def shard(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        if is_dtensor(t):
            raise AutospError(f"autosp.shard_params: a parameter is already a DTensor with placements {t.placements}. "
                              "Fix: shard a model once (fully_shard or autosp.shard_params, not both).")
        t = t.detach()
        if t.ndim == 0:            # a scalar cannot be split: replicated, its gradient all-reduced
            out = DTensor.from_local(t.clone(), flat, [Replicate()], run_check=False)
        else:
            chunk = -(-t.shape[0] // n)
            lo = min(rank * chunk, t.shape[0])
            local = t[lo:min(lo + chunk, t.shape[0])].clone()
            out = DTensor.from_local(local, flat, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())
        if param_dtype is not None or reduce_dtype is not None:
            setattr(out, _MP_ATTR, (param_dtype, reduce_dtype))
        return out.requires_grad_(requires_grad)

    if isinstance(params, nn.Module):
        done: dict[int, nn.Parameter] = {}
        for module in params.modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in done:                 # a tied weight is sharded once and shared again
                    inner = shard(p, p.requires_grad)
                    done[id(p)] = keep_policy(inner, nn.Parameter(inner, requires_grad=p.requires_grad))
                module._parameters[name] = done[id(p)]
        return params
    if isinstance(params, dict):
        return {k: shard(v, v.requires_grad) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in params.items()}
    raise AutospError(f"autosp.shard_params: got a {type(params).__name__}. Fix: pass an nn.Module or a dict of "
                      "parameter tensors.")


def mixed_precision(x) -> tuple[torch.dtype | None, torch.dtype | None]:
    return getattr(x, _MP_ATTR, (None, None))


def keep_policy(src, dst):
    """dst carries src's mixed precision policy (a detached copy of a sharded parameter)."""
    mp = getattr(src, _MP_ATTR, None)
    if mp is not None:
        setattr(dst, _MP_ATTR, mp)
    return dst


def param_shard(x, name: str, world: int) -> ParamShard | None:
    """The ParamShard of a DTensor argument (None for a replicated one); `world` is the number of ranks
    of the autosp mesh, which the parameter's placements must cover."""
    from torch.distributed.tensor import Replicate, Shard
    mesh, placements = x.device_mesh, tuple(x.placements)
    shards = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    others = [p for p in placements if not isinstance(p, (Shard, Replicate))]
    if others or len(shards) > 1 or (shards and placements[shards[0]].dim != 0):
        raise AutospError(
            f"autosp: parameter {name} is a DTensor with placements {placements} on a mesh of shape "
            f"{tuple(mesh.shape)}; autosp reads FSDP2's layout: Shard(0) on one mesh dim, Replicate on the others. "
            "Fix: autosp.shard_params(model, mesh), or fully_shard(model, mesh=...) with a 1-D mesh.")
    covered = 1
    for i in range(mesh.ndim):
        covered *= mesh.size(i)
    if covered != world:
        raise AutospError(
            f"autosp: parameter {name} is a DTensor over {covered} ranks (mesh {tuple(mesh.shape)}), but the step's "
            f"mesh has {world} ranks (dp x sp). Fix: shard the parameters over every rank of the step's mesh: "
            "autosp.shard_params(model, mesh).")
    sync = tuple(mesh.get_group(i).group_name for i, p in enumerate(placements) if isinstance(p, Replicate))
    param_dtype, reduce_dtype = mixed_precision(x)
    master = x.dtype
    if not shards:
        return None if not sync else ParamShard(0, 0, 1, "", sync, master, master, master)
    i = shards[0]
    ranks = mesh.size(i)
    rows = x.shape[0]
    return ParamShard(rows=rows, chunk=-(-rows // ranks), ranks=ranks, group=mesh.get_group(i).group_name,
                      sync=sync, master=master, dtype=param_dtype or master, reduce_dtype=reduce_dtype or master)


def local_input(x, ps: ParamShard | None) -> torch.Tensor:
    """What the sharded program takes for a DTensor argument: its local shard, padded to `chunk` rows
    (differentiable, so autograd returns the gradient to the DTensor with its placements)."""
    t = x.to_local()
    if ps is None or ps.rows == 0 or t.shape[0] == ps.chunk:
        return t
    return torch.cat([t, t.new_zeros((ps.chunk - t.shape[0],) + tuple(t.shape[1:]))])


def stand_in(x, ps: ParamShard | None, mode):
    """A fake tensor with the parameter's global shape and compute dtype, for tracing the step."""
    dtype = ps.dtype if ps is not None else x.dtype
    with mode:
        t = torch.empty(tuple(x.shape), dtype=dtype, device=x.to_local().device)
    if isinstance(x, nn.Parameter) and not x.requires_grad:     # a frozen parameter is traced as one (Role.FROZEN)
        return nn.Parameter(t, requires_grad=False)
    return t.requires_grad_(x.requires_grad)


@contextlib.contextmanager
def fsdp_hooks_off(module: nn.Module):
    """Trace a module wrapped by torch's fully_shard without its FSDP hooks: they would all-gather the
    real shards and swap them in, while autosp gathers inside the traced program (the DTensor
    parameters are read as they are). Only FSDP's own hooks (bound to its state) are held back, and
    only while the step is traced; the module is left as it was."""
    held = []
    for m in module.modules():
        for table in (m._forward_pre_hooks, m._forward_hooks):
            for key, hook in list(table.items()):
                owner = getattr(hook, "__self__", None)
                if owner is not None and type(owner).__name__ == "FSDPState":
                    held.append((table, key, hook))
                    del table[key]
    try:
        yield
    finally:
        for table, key, hook in held:
            table[key] = hook
