"""The public entry points: shard, value_and_grad, compile, explain.

    step = autosp.shard(loss_fn, mesh)            # or @autosp.shard(mesh=mesh)
    loss = step(params, input_ids, labels)        # the single-device value, on every sp rank
    loss, grads = autosp.value_and_grad(loss_fn, mesh)(params, input_ids, labels)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autosp.collectives import all_gather_objects
from autosp.errors import AutospError, TraceError
from autosp.ir.core import Graph
from autosp.ir.lower import lower
from autosp.ir.verify import verify
from autosp.params import fsdp_hooks_off, is_dtensor, keep_policy, local_input, mixed_precision, param_shard, stand_in
from autosp.passes.functionalize import functionalize
from autosp.passes.shard import shard_graph
from autosp.passes.shard_ctx import MeshInfo
from autosp.trace import autocast_state, no_autocast, trace

_AXES = ("dp", "sp")


def mesh_info(mesh) -> MeshInfo:
    """The sp (and dp) process groups of a DeviceMesh, with a clear error for any other mesh."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "sp" not in names:
        raise AutospError(
            f"autosp: the mesh has axes {names or '(unnamed)'} and no 'sp' axis to shard the sequence over. "
            "Fix: init_device_mesh('cpu', (P,), mesh_dim_names=('sp',)) or (D, P) with ('dp', 'sp').")
    extra = [n for n in names if n not in _AXES]
    if extra:
        raise AutospError(f"autosp: mesh axes {extra} are not understood (only 'dp' and 'sp'). "
                          "Fix: build the mesh with mesh_dim_names=('dp', 'sp') or ('sp',).")
    sp = mesh.get_group("sp")
    rows = mesh.mesh.movedim(names.index("sp"), -1).reshape(-1, mesh.size(names.index("sp"))).tolist()
    info = MeshInfo(sp_size=dist.get_world_size(sp), sp_group=sp.group_name,
                    sp_ranks=tuple(tuple(int(r) for r in row) for row in rows))
    if "dp" in names:
        dp = mesh.get_group("dp")
        info.dp_size, info.dp_group = dist.get_world_size(dp), dp.group_name
    return info


def _closed_over(fn, depth: int = 4) -> list[torch.Tensor]:
    """The tensors `fn` reaches through its closures, bound self, partial arguments and containers: a module's
    buffers and parameters (what a trace makes its constants)."""
    out, seen = [], set()

    def visit(obj, d):
        if d < 0 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, torch.nn.Module):
            out.extend(t for _, t in obj.named_buffers())
            out.extend(t for _, t in obj.named_parameters())
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                visit(x, d - 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                visit(x, d - 1)
        elif isinstance(obj, functools.partial):
            for x in (obj.func, *obj.args, *obj.keywords.values()):
                visit(x, d - 1)
        elif callable(obj):
            visit(getattr(obj, "__self__", None), d - 1)
            for cell in getattr(getattr(obj, "__func__", obj), "__closure__", None) or ():
                try:
                    visit(cell.cell_contents, d - 1)
                except ValueError:                      # an empty cell
                    pass

    visit(fn, depth)
    return out


def _own_constants(graph: Graph, fn) -> Graph:
    """A trace received from another rank with each constant that is one of this process's own tensors (a
    module's buffer `fn` closes over: the same dtype, shape, strides and values) taken from here, as this rank's
    own trace takes it: no second copy of a buffer, and one that changes between steps changes here too."""
    if not graph.consts:
        return graph
    mine: dict = {}
    for t in _closed_over(fn):
        if not is_dtensor(t) and t.device.type != "meta":
            mine.setdefault((t.dtype, tuple(t.shape), t.stride(), t.device), []).append(t.detach())
    consts = []
    for v, t in graph.consts:
        key = (t.dtype, tuple(t.shape), t.stride(), t.device)
        own = next((c for c in mine.get(key, ()) if torch.equal(c, t)), None)
        consts.append((v, t if own is None else own))
    return dataclasses.replace(graph, consts=tuple(consts))


class Sharded:
    """fn made sequence-parallel; compiled once per input signature (shapes, dtypes, mesh)."""

    def __init__(self, fn, mesh, in_specs=None, out_specs=None, memory_budget=None, host_bandwidth=None, ring=None,
                 host_memory=None, tiles=None, compile=False):  # noqa: A002 - the flag's name, as torch's
        from autosp.remat.plan import parse_budget, parse_host_memory
        self.fn, self.mesh, self.in_specs, self.out_specs = fn, mesh, in_specs, out_specs
        self.compiled = bool(compile)
        if self.compiled and memory_budget is None:     # compiled, the step runs as a plan: what autograd saves
            memory_budget = 1.0
        self.tiles = _check_tiles(tiles, memory_budget)
        self.memory_budget, self.host_bandwidth = memory_budget, host_bandwidth
        self.host_memory = parse_host_memory(host_memory)   # a bad size fails here, not at the first call
        if memory_budget is not None:
            parse_budget(memory_budget)
        self.info = mesh_info(mesh)
        self.info.ring = ring
        self.trace_context = contextlib.nullcontext     # what the trace runs under (ShardedModule: FSDP hooks off)
        self._cache: dict = {}
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "sharded")

    # ------------------------------------------------------------ compile
    def _check_args(self, args):
        try:
            inspect.signature(self.fn).bind(*args)
        except TypeError as exc:
            raise AutospError(f"autosp.shard({self.__name__}): {exc} (got {len(args)} arguments). "
                              "Fix: call with the arguments the single-device function takes.") from None
        except ValueError:
            pass

    def _signature(self, leaves):
        return tuple((tuple(x.shape), x.dtype, x.requires_grad, isinstance(x, torch.nn.Parameter), x.device.type)
                     + ((tuple(x.placements), _mesh_groups(x.device_mesh), mixed_precision(x)) if is_dtensor(x) else ())
                     if isinstance(x, torch.Tensor) else ("static", x) for x in leaves)

    def _param_shards(self, args) -> list:
        """Per pytree leaf: the ParamShard of a DTensor parameter (autosp.params), else None."""
        leaves, _ = pytree.tree_flatten(args)
        paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(args)[0]]
        world = self.info.sp_size * self.info.dp_size
        return [param_shard(x, path, world) if is_dtensor(x) else None for x, path in zip(leaves, paths)]

    def _agree(self, sig, leaves, paths):
        """All sp ranks must pass the same global values: compare shapes and checksums once per compile."""
        group = dist.distributed_c10d._resolve_process_group(self.info.sp_group)
        sums = [_checksum(x) for x in leaves]
        sigs = all_gather_objects((repr(sig), sums), group)
        mine = dist.get_rank(group)
        for other, (_, their) in enumerate(sigs):
            bad = [i for i, (a, b) in enumerate(zip(sums, their)) if a != b]
            if sigs[other][0] == sigs[mine][0] and bad:
                raise AutospError(
                    f"autosp.shard({self.__name__}): sp rank {mine} and sp rank {other} passed different values for "
                    f"argument {paths[bad[0]]} (checksums {sums[bad[0]]} vs {their[bad[0]]}). Every rank of an sp "
                    "group must pass the same global batch and parameters. Fix: seed identically on every rank, "
                    "or broadcast the batch from the group's first rank.")
        sigs = [s for s, _ in sigs]
        if len(set(sigs)) > 1:
            other = next(i for i, s in enumerate(sigs) if s != sigs[mine])
            raise AutospError(
                f"autosp.shard({self.__name__}): sp rank {mine} and sp rank {other} passed arguments of different "
                f"shapes or dtypes:\n  rank {mine}: {sigs[mine][:400]}\n  rank {other}: {sigs[other][:400]}\n"
                "Fix: every rank of an sp group passes the same global batch (shard along dp instead).")

    def graphs(self, *args, shards=None, global_graph: Graph | None = None) -> tuple[Graph, Graph]:
        """(global trace, per-rank sharded graph) for these arguments. DTensor parameters (FSDP2's
        layout) are traced with their global shapes and gathered in the per-rank graph; `shards`:
        _param_shards(args), where the caller has them; `global_graph`: the global trace of this
        function on these arguments, where the caller has it (from graphs() on another mesh: the trace
        does not depend on the mesh), so that only the sharding pass runs."""
        self._check_args(args)
        shards = self._param_shards(args) if shards is None else shards
        if global_graph is not None:
            return global_graph, self._shard(global_graph, args, shards)
        graph = self._trace(args, shards)
        return graph, self._shard(graph, args, shards)

    def _trace(self, args, shards) -> Graph:
        """The global trace of fn on these arguments (DTensor parameters stand in at their global shapes)."""
        traced = args
        if any(is_dtensor(x) for x in pytree.tree_leaves(args)):
            from torch._subclasses.fake_tensor import FakeTensorMode
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            leaves, spec = pytree.tree_flatten(args)
            traced = pytree.tree_unflatten([stand_in(x, ps, mode) if is_dtensor(x) else x
                                            for x, ps in zip(leaves, shards)], spec)
        try:
            with self.trace_context():
                graph = functionalize(trace(self.fn, *traced))
        except TraceError as exc:
            if traced is args or self.trace_context is not contextlib.nullcontext:
                raise
            raise TraceError(f"{exc}\n  The arguments hold DTensor parameters: if the function calls a module wrapped "
                             "by torch's fully_shard, FSDP's hooks ran while autosp traced it. Fix: "
                             "autosp.compile(model, mesh) (which holds them back), or shard the parameters with "
                             "autosp.shard_params(model, mesh) instead of fully_shard.") from None
        return graph

    def _shared_trace(self, args, shards) -> Graph | None:
        """The global trace made once per sp group where its ranks are CPU processes (gloo), which share the
        machine's cores: the group's first rank traces and the others receive it (ir/serial.py) after _agree has
        found their arguments the same; each still shards it for itself. A trace it cannot send (a fake tensor
        among its constants) is made by every rank, and a trace that fails fails on every rank with the first
        rank's error. None where the ranks trace for themselves (a GPU's ranks have a core each)."""
        from autosp.collectives import broadcast_bytes
        from autosp.ir.serial import dumps, loads
        group = dist.distributed_c10d._resolve_process_group(self.info.sp_group)
        if dist.get_world_size(group) == 1 or dist.get_backend(group) != "gloo":
            return None
        if dist.get_rank(group) != 0:
            got = loads(broadcast_bytes(None, group))
            if got[0] == "error":
                raise got[1]
            return _own_constants(got[1], self.fn) if got[0] == "ok" else None
        try:
            graph = self._trace(args, shards)
        except Exception as exc:
            try:
                sent = dumps(("error", exc))
                same = str(loads(sent)[1]) == str(exc)
            except Exception:  # noqa: BLE001 - an error that does not pickle goes as its text
                same = False
            if not same:                # nor one that comes back without its message (torch's symbolic errors)
                sent = dumps(("error", AutospError(f"sp rank 0 could not trace {self.__name__}: "
                                                   f"{type(exc).__name__}: {exc}")))
            broadcast_bytes(sent, group)
            raise
        try:
            sent = dumps(("ok", graph))
        except Exception:  # noqa: BLE001 - each rank traces for itself
            sent = dumps(("trace",))
        broadcast_bytes(sent, group)
        return graph

    def _shard(self, graph: Graph, args, shards) -> Graph:
        """The per-rank graph of the global trace `graph` on this mesh."""
        tensors = [ps for x, ps in zip(pytree.tree_leaves(args), shards) if isinstance(x, torch.Tensor)]
        params = {v.name: ps for v, ps in zip(graph.inputs, tensors) if ps is not None}
        specs = _flat_specs(self.in_specs, args, graph)
        keep = _keep_sharded(self.out_specs, graph)
        local = shard_graph(graph, self.info, in_specs=specs, keep_sharded=keep, params=params)
        if os.environ.get("AUTOSP_CHECKS") == "1":
            verify(local)
        return local

    def compile(self, *args):
        leaves, spec = pytree.tree_flatten(args)
        key = (spec, self._signature(leaves), autocast_state())
        hit = self._cache.get(key)
        if hit is None:
            self._check_args(args)
            shards = self._param_shards(args)          # a DTensor autosp cannot read fails here, on every rank
            paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(args)[0]]
            self._agree(key[1], leaves, paths)
            _, local = self.graphs(*args, shards=shards, global_graph=self._shared_trace(args, shards))
            if self.memory_budget is None:
                hit = (local, lower(local), None, shards)
            else:
                plan, runner = self._remat(local, leaves)
                hit = (local, runner, plan, shards)
            self._cache[key] = hit
        return hit

    def _remat(self, local: Graph, leaves):
        """The step with a remat plan: joint graph, plan (the same on every sp rank), runner."""
        from autosp.remat import compile_step
        plan, runner = compile_step(local, self.memory_budget, device=_device_of(leaves),
                                    host_bandwidth=self.host_bandwidth, host_memory=self.host_memory,
                                    group=self.info.sp_group, tiles=self.tiles, compiled=self.compiled)
        return plan, runner

    def compile_report(self) -> tuple[float, str] | None:
        """compile=True: (seconds inductor took, its on-disk cache: 'hit', 'miss' or 'mixed') over the programs
        compiled so far, which compile at their first call; None before any has."""
        runs = [p for _, runner, _, _ in self._cache.values() if getattr(runner, "compiled", False)
                for p in (runner.forward, runner.backward) if p.seconds is not None]
        if not runs:
            return None
        kinds = {p.cache for p in runs}
        return sum(p.seconds for p in runs), kinds.pop() if len(kinds) == 1 else "mixed"

    def plan(self, *args):
        """The remat plan for these arguments (compiles if needed)."""
        return self.compile(*args)[2]

    def __call__(self, *args):
        local, module, _, shards = self.compile(*args)
        leaves, _ = pytree.tree_flatten(args)
        leaves = [local_input(x, ps) if is_dtensor(x) else x for x, ps in zip(leaves, shards)]
        static = {i for i, _ in local.static_args}
        with no_autocast():                 # the program holds autocast's casts (trace.explicit_autocast)
            outs = module(*[x for i, x in enumerate(leaves) if i not in static])
        return pytree.tree_unflatten(list(outs), local.out_spec)


def _mesh_groups(mesh) -> tuple[str, ...]:
    """A DeviceMesh by its process groups' names (the same on every rank, unlike the object)."""
    return tuple(mesh.get_group(i).group_name for i in range(mesh.ndim))


def _checksum(x) -> int | None:
    """An exact, order-independent checksum of a tensor's bytes (integer sums do not depend on
    thread counts the way float sums do), or None for non-tensors, meta tensors and DTensors (each
    rank holds its own shard)."""
    if not isinstance(x, torch.Tensor) or x.device.type == "meta" or is_dtensor(x):
        return None
    raw = x.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    return int(words.to(torch.int64).sum()) ^ (int(words[::7].to(torch.int64).sum()) << 1)


def _flat_specs(in_specs, args, graph: Graph):
    if in_specs is None:
        return None
    if not isinstance(in_specs, tuple):
        in_specs = (in_specs,)
    leaves, spec = pytree.tree_flatten(args)
    try:
        flat = pytree._broadcast_to_and_flatten(tuple(in_specs), spec)
    except Exception:  # noqa: BLE001
        flat = None
    if flat is None:
        raise AutospError(f"autosp.shard: in_specs {in_specs!r} does not match the arguments' structure {spec}. "
                          "Fix: give one spec (or None) per argument, e.g. in_specs=(None, 'b s', 'b s').")
    static = {i for i, _ in graph.static_args}
    return [s for i, s in enumerate(flat) if i not in static]


def _keep_sharded(out_specs, graph: Graph) -> set[int]:
    if out_specs is None:
        return set()
    specs = out_specs if isinstance(out_specs, (list, tuple)) else [out_specs] * len(graph.outputs)
    return {i for i, s in enumerate(specs) if isinstance(s, str) and "sp" in s}


def _check_tiles(tiles, memory_budget):
    if tiles is None:
        return None
    fix = "Fix: tiles={'loss': 8, 'mlp': 4} (chain names as autosp.explain prints them, 'mlp' for every MLP)."
    if memory_budget is None:
        raise AutospError(f"tiles={tiles!r}: tiling is planned with the remat plan, which needs a memory_budget. "
                          "Fix: add memory_budget=1.0 (save what autograd saves) or a budget.")
    if not isinstance(tiles, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                              and v >= 1 for k, v in tiles.items()):
        raise AutospError(f"tiles={tiles!r}: expected a dict of chain name -> tiles (an int >= 1). {fix}")
    return dict(tiles)


def shard(fn=None, mesh=None, *, in_specs=None, out_specs=None, memory_budget=None, host_bandwidth=None,
          host_memory=None, ring=None, tiles=None, compile=False):  # noqa: A002
    """fn's sequence-parallel twin over mesh's 'sp' axis; also usable as @shard(mesh=mesh).

    memory_budget: None (save what autograd saves), a fraction of that step's peak (0.3), or
    bytes per rank (an int, '20GiB'): the remat plan then saves, recomputes or offloads each
    activation to fit. host_bandwidth (bytes/s) lets the plan offload to host memory (a GPU has one);
    host_memory (bytes per rank, or '64GiB') caps what it offloads (None: no limit, 0: no offload).
    ring: attention over sp = U x R ranks runs an all-to-all over U and ring attention over R = `ring`;
    None lets autosp factorise (the largest U that divides the query heads; a ring only where heads run out).
    tiles: the position-wise chains (the MLPs, the loss head) run in tiles along the sequence, chain
    name -> tiles ({'loss': 16, 'mlp': 4}); None lets the planner tile where the budget needs it.
    compile: each rank's forward and backward programs through inductor (autosp.ir.inductor), the remat
    plan kept; without a memory_budget the step is planned at 1.0 (what autograd saves).
    """
    if fn is None:
        return lambda f: Sharded(f, mesh, in_specs, out_specs, memory_budget, host_bandwidth, ring, host_memory,
                                 tiles, compile)
    if mesh is None:
        raise AutospError("autosp.shard: no mesh given. Fix: autosp.shard(fn, mesh) or @autosp.shard(mesh=mesh).")
    return Sharded(fn, mesh, in_specs, out_specs, memory_budget, host_bandwidth, ring, host_memory, tiles, compile)


def value_and_grad(fn, mesh, *, in_specs=None, out_specs=None, memory_budget=None, host_bandwidth=None,
                   host_memory=None, ring=None, tiles=None, compile=False, has_aux=False):  # noqa: A002
    """JAX-style: (loss, grads of the first argument), both the single-device values on every sp rank.
    has_aux: fn returns (loss, aux), aux not differentiated; the result is ((loss, aux), grads)."""
    step = shard(fn, mesh, in_specs=in_specs, out_specs=out_specs, memory_budget=memory_budget,
                 host_bandwidth=host_bandwidth, host_memory=host_memory, ring=ring, tiles=tiles, compile=compile)

    def run(params, *rest):
        params = _differentiable(params)
        live, spec = pytree.tree_flatten(params)
        loss = step(params, *rest)
        aux = None
        if has_aux:
            loss, aux = loss
        wrt = [x for x in live if isinstance(x, torch.Tensor) and x.requires_grad]
        grads = iter(torch.autograd.grad(loss, wrt, allow_unused=True))
        out = [next(grads) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in live]
        out = [torch.zeros_like(x) if g is None and isinstance(x, torch.Tensor) else g for x, g in zip(live, out)]
        grads = pytree.tree_unflatten(out, spec)
        if has_aux:
            return (loss.detach(), pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x,
                                                   aux)), grads
        return loss.detach(), grads

    run.sharded = step
    run.plan = lambda params, *rest: step.plan(_differentiable(params), *rest)     # compiles; None without a budget
    return run


class ShardedModule(torch.nn.Module):
    """nn.Module path: forward is sharded; loss.backward() fills the module's .grad as usual."""

    def __init__(self, module: torch.nn.Module, mesh, in_specs=None, out_specs=None, memory_budget=None,
                 host_bandwidth=None, ring=None, host_memory=None, tiles=None, compile=False):  # noqa: A002
        super().__init__()
        self.module = module
        options = dict(in_specs=in_specs, out_specs=out_specs, memory_budget=memory_budget,
                       host_bandwidth=host_bandwidth, host_memory=host_memory, ring=ring, tiles=tiles, compile=compile)
        # one program per mode (dropout's differs), each traced on its mode's first call
        self._steps = {mode: shard(self._call, mesh, **options) for mode in (True, False)}
        for step in self._steps.values():
            # a module wrapped by torch's fully_shard: its parameters are read as DTensors, its hooks not run
            step.trace_context = lambda: fsdp_hooks_off(module)

    @property
    def _step(self):
        return self._steps[self.module.training]

    def _call(self, params, args, kwargs):
        return torch.func.functional_call(self.module, params, args, kwargs)

    def forward(self, *args, **kwargs):
        return self._step(dict(self.module.named_parameters()), args, kwargs)


def compile(model: torch.nn.Module, mesh, *, in_specs=None, out_specs=None, memory_budget=None,  # noqa: A001
            host_bandwidth=None, host_memory=None, ring=None, tiles=None, compile=False) -> ShardedModule:  # noqa: A002
    """nn.Module path of shard (its flags, `compile` too)."""
    return ShardedModule(model, mesh, in_specs, out_specs, memory_budget, host_bandwidth, ring, host_memory, tiles,
                         compile)


def _differentiable(params):
    """The first argument's floating leaves as fresh leaves that require grad (value_and_grad's view)."""
    leaves, spec = pytree.tree_flatten(params)
    live = [keep_policy(x, x.detach().requires_grad_(True)) if isinstance(x, torch.Tensor) and x.is_floating_point()
            else x for x in leaves]
    return pytree.tree_unflatten(live, spec)


def _device_of(args) -> str:
    """The device type the arguments' tensors live on, for the cost model (meta tensors: cpu)."""
    kinds = [x.device.type for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
    return next((k for k in kinds if k != "meta"), "cpu")


def plan(fn, mesh, *args, memory_budget=None, in_specs=None, host_bandwidth=None, host_memory=None,
         device: str | None = None, ring=None, tiles=None):
    """The remat plan of value_and_grad(fn, mesh, memory_budget=...) on these arguments; runs nothing.

    Arguments may be meta tensors. The gradient is taken w.r.t. the first argument, as in
    value_and_grad. `device` ('cpu', 'cuda' or a GPU of autosp.remat.cost.GPUS such as 'h100') picks the cost
    and memory model, each op priced at the kernel that device runs; by default the arguments' device.
    `host_memory`: bytes per rank (or '64GiB') that offloaded activations may take; None: no limit.
    """
    from autosp.remat import plan_step
    if not args:
        raise AutospError("autosp.plan: no arguments. Fix: autosp.plan(fn, mesh, params, *batch, memory_budget=0.3).")
    args = (_differentiable(args[0]),) + tuple(args[1:])
    _, local = Sharded(fn, mesh, in_specs, ring=ring).graphs(*args)
    return plan_step(local, memory_budget, device=device or _device_of(args), host_bandwidth=host_bandwidth,
                     host_memory=host_memory, tiles=_check_tiles(tiles, memory_budget))[0]


def explain(fn, mesh, *args, in_specs=None, memory_budget=None, host_bandwidth=None, host_memory=None,
            ring=None, tiles=None, device: str | None = None) -> str:
    """The chain printed: the global trace, the per-rank graph with layouts and collectives, and,
    with a memory_budget, the remat plan with its predicted peak (the gradient is taken w.r.t.
    the first argument, as in value_and_grad). `device`: as autosp.plan's."""
    device = device or _device_of(args)
    if memory_budget is not None and args:
        args = (_differentiable(args[0]),) + tuple(args[1:])
    sharded = Sharded(fn, mesh, in_specs, ring=ring)
    graph, local = sharded.graphs(*args)
    colls = [e for e in local.eqns if e.op.name in ("all_to_all", "all_reduce_sum", "all_gather_seq",
                                                     "all_gather_param", "halo_exchange")]
    head = (f"# autosp.explain: sp={mesh_info(mesh).sp_size}, {len(graph.eqns)} global equations -> "
            f"{len(local.eqns)} per-rank, collectives: "
            + ", ".join(f"{n}x{sum(e.op.name == n for e in colls)}" for n in sorted({e.op.name for e in colls})))
    from autosp.passes.dce import dce
    from autosp.passes.shard import analyse
    live = dce(graph)
    regions = analyse(live, mesh_info(mesh), _flat_specs(sharded.in_specs, args, graph)).summary(live)
    parts = [head, regions, attention_summary(local, device, mesh_info(mesh).sp_size)]
    state = model_state_summary(local)
    if state:
        parts.append(state)
    parts += [str(graph), str(local)]
    if memory_budget is not None:
        from autosp.remat import plan_step
        plan, program, _, _ = plan_step(local, memory_budget, device=device, host_bandwidth=host_bandwidth,
                                        host_memory=host_memory, tiles=_check_tiles(tiles, memory_budget))
        from autosp.passes.schedule import overlap_summary, schedule_program
        from autosp.remat.cost import device_for
        parts += [str(plan), attention_backward_summary(program, device),
                  overlap_summary(program, device_for(device, host_bandwidth), full=True)]
        scheduled = schedule_program(program)
        parts += [str(scheduled.forward), str(scheduled.backward)]
    return "\n\n".join(parts)


def model_state_summary(local: Graph) -> str:
    """One line per sharded parameter of the per-rank program: its shard, what the gather moves and where
    it is issued, and the gradient's reduce-scatter ("" when no parameter is sharded)."""
    from autosp.ir.core import dtype_short
    from autosp.remat.plan import _fmt as _fmt_bytes
    eqns = list(local.eqns)
    gathers = [(i, e) for i, e in enumerate(eqns) if e.op.name == "all_gather_param"]
    if not gathers:
        return ""
    first = {}
    for i, e in enumerate(eqns):
        for x in e.inputs:
            first.setdefault(x.name, i)
    lines = ["# model state: parameters sharded on dim 0, gathered before use, gradients reduce-scattered"]
    total_in = total_out = 0
    for i, e in gathers:
        x, out = e.inputs[0], e.outputs[0]
        args = e.var_args()[0]
        reduce_dtype = args[4]
        grad = out.numel() * reduce_dtype.itemsize
        total_in += out.nbytes()
        total_out += grad
        use = first.get(out.name)
        lines.append(f"  {x.name}: shard {x.type_str()} -> all_gather_param {out.type_str()} "
                     f"({_fmt_bytes(out.nbytes())}) at equation {i}, first used at {use}; gradient reduce_scatter_param "
                     f"{_fmt_bytes(grad)} in {dtype_short(reduce_dtype)}")
    lines.append(f"  per step and rank: {len(gathers)} gathers ({_fmt_bytes(total_in)} gathered), {len(gathers)} "
                 f"reduce-scatters ({_fmt_bytes(total_out)} reduced); a gathered copy the backward needs is saved or "
                 "gathered again, as the remat plan chooses")
    return "\n".join(lines)


def attention_summary(local: Graph, device: str, sp: int | None = None) -> str:
    """One line per attention of the per-rank program: what its mask is and what runs it (the kernel
    lowering picks, autosp/ir/lower.py's attention_kernel)."""
    from autosp.ir.lower import attention_kernel
    lines = ["# attention"]
    for e in local.eqns:
        where = f" at {e.source}" if e.source else ""
        if e.op.name == "masked_attention":
            args = e.var_args()[0]
            leaves = ", ".join(f"x{i}: {v.type_str()}" for i, v in enumerate(args[3]))
            from autosp.kernels.masked import describe
            kernel = describe(args[4], device, args[3])
            lines.append(f"  masked_attention{where}: mask = {args[4]}{'  [' + leaves + ']' if leaves else ''}; "
                         f"no s x s tensor, memory O(block * s); {kernel}")
        elif e.op.name in ("ring_attention", "ring_masked_attention"):
            from autosp.remat.cost import ring_size
            from autosp.remat.plan import _fmt as _fmt_bytes
            from autosp.ring import ring_send_bytes
            args = e.var_args()[0]
            r = ring_size(e)
            k, v = e.inputs[1], e.inputs[2]
            sent, sent_back = ring_send_bytes(*(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in (k, v)), r)
            split = f"sp {sp} = all-to-all over {sp // r} x ring over {r}" if sp else f"a ring over {r} ranks"
            what = f"mask = {args[9]} (no s x s tensor)" if len(args) > 9 else 'causal' if args[3] else 'no mask'
            lines.append(f"  {e.op.name}{where}: {what}, {split}, "
                         f"{'zigzag order (balanced causal work)' if args[6] else 'contiguous order'}; "
                         f"per layer and rank it sends {_fmt_bytes(sent)} forward (R-1 K/V blocks of "
                         f"{_fmt_bytes(k.nbytes() + v.nbytes())}), {_fmt_bytes(sent_back)} backward")
        elif e.op.name == "flash_attention":
            lines.append(f"  flash_attention{where}: {'causal' if e.var_args()[0][3] else 'no mask'}, autosp's Triton "
                         "kernel (called directly)")
        elif e.op.name == "attention" and e.op.target is torch.ops.aten.scaled_dot_product_attention.default:
            b = e.bind_schema()
            mask = b.get("attn_mask")
            causal = "causal" if b.get("is_causal") else "no mask"
            if mask is not None:
                lines.append(f"  sdpa{where}: mask materialised as a tensor {mask.type_str()}: O(s^2) memory per rank "
                             "(not a function of per-query and per-key vectors)")
            elif attention_kernel(e) == "flash":
                lines.append(f"  flash_attention{where}: {causal}, autosp's Triton kernel (the GPU check measured it "
                             "faster than SDPA at this shape)")
            else:
                from autosp.remat import liveness
                from autosp.remat.cost import device_for
                dev = device_for(device)
                why = ("" if dev.kind == "cpu" else f" on {dev.name}: {liveness.sdpa_backend(dev.attention, e.inputs[0])}"
                       " (no GPU check measured autosp's Triton kernel faster at this shape)")
                lines.append(f"  sdpa{where}: {causal}, SDPA's fused kernel{why}")
    return "\n".join(lines) if len(lines) > 1 else "# attention: none"


def attention_backward_summary(program, device: str) -> str:
    """One line per attention backward of a planned step: the kernel `device` runs for it and the scratch the memory
    model prices it at (its own, beyond its inputs and outputs)."""
    from autosp.remat import liveness
    from autosp.remat.plan import _fmt as _fmt_bytes
    lines = [f"# attention backward on {device}: the kernel and its scratch, as the memory model prices them"]
    for e in program.backward.eqns:
        kernel = liveness.attention_backward_kernel(e, device)
        if kernel is not None:
            q, k = e.inputs[1], e.inputs[2]
            lines.append(f"  {kernel}: q {q.type_str()}, k {k.type_str()} -> scratch "
                         f"{_fmt_bytes(liveness.workspace(e, device))}")
    return "\n".join(lines) if len(lines) > 1 else "# attention backward: none"
