"""`autosp plan`'s probes: the longest sequence each rank can train, from the memory model (answer.py writes the answers).

For a model, a mesh (sp, dp) and a memory size per rank it answers for three configurations:
no sequence parallelism (every sequence whole on every rank), SP without remat, and SP with
autosp's ILP plan (save / recompute, and offload under the GPU cost model). Per rank it counts:

    fp32 master parameters + moments    sharded over all dp x sp ranks (autosp.shard_params, FSDP2's
                                        layout and mixed precision); --no-shard-params: parameters
                                        in the compute dtype and the moments replicated on every rank
    + the step's peak                   activations, temporaries, collective buffers, the gathered
                                        compute copies of the parameters and the parameters'
                                        gradients (or gradient shards), from the liveness model of
                                        the joint forward + backward program (autosp.remat), traced
                                        with the parameters as they are laid out: sharded, the
                                        program gathers them (all_gather_param) and reduce-scatters
                                        their gradients (reduce_scatter_param)

Host memory (per node, shared by its min(ranks, 8) ranks) is counted apart: only what the ILP plan
offloads goes there, and with --offload each rank's share is the plan's host capacity (the ILP holds
the offloaded bytes within it).

How the length is found without tracing at every candidate length: every value of the program is
either independent of the sequence length L or proportional to it, and the executed order does not
depend on L, so for a fixed program the bytes live at each equation are affine in L, and the peak is
the largest of those affine functions. Two meta traces (L1, L2) fix them exactly; the longest L is
then solved for, per equation. That holds for every fixed program, a remat plan's too: the plan with
the least peak found at L2 is replayed on the step traced at L1 (the same values saved, offloaded and
recomputed), so its longest length is exact. Only peaks are asked for (the least-peak search without the
cheapest-plan solve after it), so the row's traffic is that plan's, not the cheapest's. Each program
is differentiated once, at one of the two lengths; its joint at the other is re-instantiated from it
(passes/rescale.py: the sizes that move between the two forward traces moved, each equation checked on
fake tensors), which costs a fraction of differentiating again.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from autosp.errors import AutospError
from autosp.run.meshes import planning_mesh
from autosp.run.models import build_model, count_parameters
from autosp.units import fmt_bytes as fmt  # answer, explain and train read it from here

_MOMENTS = {"adamw": 2, "sgd": 0}            # fp32 optimizer moments per parameter
_COLLECTIVES = ("all_to_all", "all_reduce_sum", "all_gather_seq", "all_gather_param", "reduce_scatter_param",
                "halo_exchange", "halo_grad")


# ---------------------------------------------------------------- programs at one length

@dataclass
class Programs:
    """A model traced and sharded at one length: its global graph, the per-rank (SP) graph, and the
    program of the no-SP configuration (the global graph, or with sharded parameters the per-rank
    graph on a dp = all ranks, sp = 1 mesh: the parameters gathered, the sequence whole)."""
    length: int
    graph: object
    local: object
    single: object | None


def master_bytes(model, ranks: int, sharded: bool, dtype) -> int:
    """Bytes of one rank's parameters as the step keeps them across steps, from the model's global shapes:
    sharded, the fp32 master shard of the fullest rank (ceil(rows / ranks) rows of every parameter, FSDP2's
    split; a scalar whole); else every parameter in `dtype`. The planner and the training ranks both count
    with it, so the budget a rank plans under is the one `autosp plan` answered for."""
    if not sharded:
        return sum(p.numel() for p in model.parameters()) * dtype.itemsize
    # a frozen parameter (LoRA's base, run/lora.py) has no master: it is kept in the compute dtype
    return sum(fullest_shard(p, ranks) * (4 if p.requires_grad else dtype.itemsize) for p in model.parameters())


def fullest_shard(p, ranks: int) -> int:
    """Elements of the fullest rank's Shard(0) of `p` over `ranks` (FSDP2's split: ceil(rows / ranks) rows; a scalar
    whole)."""
    rows = p.shape[0] if p.ndim else 1
    return min(-(-rows // ranks), rows) * (p.numel() // max(1, rows))


def step_loss(model, params, input_ids, labels, position_ids=None, num_items=None):
    """The training step's loss, the single-device code autosp shards: a causal LM's mean next-token loss (position
    ids for packed documents, data.py); with `num_items` (a scalar tensor), its sum divided by it (token_mean.py)."""
    kwargs = {"labels": labels}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if num_items is not None:
        kwargs["num_items_in_batch"] = num_items
    return torch.func.functional_call(model, params, (input_ids,), kwargs).loss


class Tracer:
    """Meta traces of one model on one planning mesh, at any length. `shard_params`: the parameters
    are fp32 master shards over every rank of the mesh (autosp.shard_params, FSDP2's layout), gathered
    in `dtype` and their gradients reduce-scattered in `reduce_dtype`; else replicated in `dtype`.
    `ring`: autosp.shard's (attention over sp = U x R)."""

    def __init__(self, spec, mesh, dtype, batch: int, sp: int, *, shard_params: bool = False, ring: int | None = None,
                 reduce_dtype=torch.float32, packing: str = "concat", objective: str = "sft", beta: float = 0.1,
                 lora=None):
        import autosp
        from autosp.api import mesh_info
        self.sp, self.ring, self.packing = sp, ring, packing
        self.objective, self.beta = objective, beta
        self.sharded = shard_params
        self.model = build_model(spec, device="meta", dtype=torch.float32 if shard_params else dtype)
        self.lora = lora
        if lora is not None:            # the adapters train; the base is the step's second argument (run/lora.py)
            from autosp.run import lora as lora_
            self.model = lora_.apply(self.model, lora)
            lora_.freeze_dtype(self.model, dtype)
        params = {k: v.detach().requires_grad_(v.requires_grad) for k, v in self.model.named_parameters()}
        self.mesh, self.batch = mesh, batch
        self.n_params = count_parameters(self.model)
        self.single_mesh = None
        self.ranks = mesh.size() if shard_params else 1
        self.param_bytes = master_bytes(self.model, self.ranks, shard_params, dtype)
        self.trainable_bytes = None if lora is None else lora_.adapter_bytes(self.model, self.ranks, shard_params)
        self.compute_bytes = self.n_params * dtype.itemsize     # the gathered copy of the whole model
        if shard_params:
            params = autosp.shard_params(params, mesh, param_dtype=None if dtype == torch.float32 else dtype,
                                         reduce_dtype=reduce_dtype)
            self.single_mesh = mesh if mesh_info(mesh).sp_size == 1 else planning_mesh(1, self.ranks)
        self.params = params
        # the step's leading arguments: the parameters, or LoRA's adapters and frozen base (parameters without
        # requires_grad, as train passes them: traced as Role.FROZEN)
        self.head = (params,) if lora is None else (
            {k: v for k, v in params.items() if v.requires_grad},
            {k: torch.nn.Parameter(v, requires_grad=False) for k, v in params.items() if not v.requires_grad})

    def loss_fn(self, *args):
        """The step's loss on step_args: (parameters, or LoRA's adapters and frozen base), then DPO's pairs and
        their reference log-probabilities (run/dpo.py), or the ids, labels and position ids."""
        if self.lora is not None:
            adapters, base, *args = args
            params = {**base, **adapters}
        else:
            params, *args = args
        if self.objective == "dpo":
            from autosp.run.dpo import dpo_loss
            return dpo_loss(self.model, self.beta)(params, *args)
        return step_loss(self.model, params, *args)

    def step_args(self, length: int) -> tuple:
        """The step's arguments on meta tensors: DPO's 2 sequences per pair (ids, labels) and their reference
        log-probabilities (run/dpo.py); else the ids (as labels too) and, packed, position ids."""
        if self.objective == "dpo":
            ids = torch.zeros(2 * self.batch, length, dtype=torch.long, device="meta")
            return self.head + (ids, ids, torch.zeros(2 * self.batch, device="meta"))
        ids = torch.zeros(self.batch, length, dtype=torch.long, device="meta")
        return self.head + (ids, ids) + ((torch.zeros_like(ids),) if self.packing == "docs" else ())

    shared = None       # a _Shared of the probe's two processes, while they run
    key = None          # what the traces are a function of besides the length (run/answer.py: the step without
                        # it): traces made under one key are kept (_TRACED) to place others on their line

    def trace(self, length: int, single: bool = True) -> Programs:
        """The programs at `length`; single=False: without the no-SP program where it takes another
        sharding pass (sharded parameters: None in its place)."""
        got = self.shared.get(length) if self.shared is not None else None
        if got is None:
            graph, local = self._graphs(self.mesh, length)
            if self.shared is not None:
                self.shared.put(length, (graph, local))
        else:
            graph, local = got
        if self.key is not None:
            kept = _TRACED.pop(self.key, {})
            _TRACED[self.key] = kept                # the most recent step last; the oldest dropped
            while len(_TRACED) > 4:
                _TRACED.pop(next(iter(_TRACED)))
            kept[length] = local
            for drop in sorted(kept)[1:-1]:     # the two farthest apart are the line's
                del kept[drop]
        single_program = None
        if not self.sharded:
            single_program = graph
        elif self.single_mesh is self.mesh:
            single_program = local
        elif single:                    # the same global trace, sharded for the dp = all ranks mesh
            single_program = self._graphs(self.single_mesh, length, graph)[1]
        return Programs(length, graph, local, single_program)

    def local(self, length: int):
        """The SP step's forward at `length` (Programs.local): placed on the line through two traces of the same
        step at other lengths where this process has them (passes/rescale.extrapolate: a tenth of a trace for
        the 8B step; `autosp plan` checks its answer at a few lengths after probing two), else traced."""
        from autosp.passes.rescale import RescaleError, extrapolate
        kept = _TRACED.get(self.key, {}) if self.key is not None else {}
        if length in kept:
            return kept[length]
        if len(kept) >= 2:
            la, lb = min(kept), max(kept)
            try:
                return extrapolate(kept[la], la, kept[lb], lb, length)
            except RescaleError:
                pass
        return self.trace(length, single=False).local

    def _graphs(self, mesh, length: int, global_graph=None):
        """autosp.shard(...).graphs at `length` (of `global_graph`, the global trace, where given), traced
        without source lines (a tenth of the trace); an error is raised from a second trace with them, so
        that it names the line."""
        import autosp
        from autosp.trace import without_sources
        args = self.step_args(length)
        sharded = autosp.shard(self.loss_fn, mesh, ring=self.ring if mesh is self.mesh else None)
        try:
            with without_sources():
                return sharded.graphs(*args, global_graph=global_graph)
        except AutospError:
            return sharded.graphs(*args, global_graph=global_graph)


_TRACED: dict = {}      # Tracer.key -> {length: the SP step's forward}: two per key, four keys, for Tracer.local


class _Shared:
    """What the probe's two processes hand each other, passed through files (each written whole, then
    renamed into place), so that neither ever waits for the other: a process that finds nothing handed
    over derives it itself.

    - the traces: the first to trace a length hands it over. Each traces first the length it needs
      first (the short one here, the long one in the search), so each finds the other's.
    - the replay's joint (`parallel` only): the search hands over the tiled step's joint at l2 as soon as
      it is derived (SEARCHED), and the short probe, idle once its own programs are priced, re-instantiates
      it at l1 (LENT) for the search's replay of its plan there, which then costs nothing to re-instantiate
      (the tiny preset: 0.4 s of the search's 4 s)."""

    SEARCHED, LENT = "searched.joints", "lent.joints"

    def __init__(self, parallel: bool = True):
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="autosp-plan-")
        self.parallel = parallel

    def _path(self, name) -> str:
        return os.path.join(self.dir, f"{name}.trace" if isinstance(name, int) else name)

    def put(self, name, value) -> None:
        """Hand over `value` under `name` (a length: its traces)."""
        from autosp.ir.serial import dumps
        tmp = f"{self._path(name)}.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(dumps(value))
        os.replace(tmp, self._path(name))

    def get(self, name):
        """What the other process handed over under `name`, or None."""
        from autosp.ir.serial import loads
        try:
            with open(self._path(name), "rb") as f:
                return loads(f.read())
        except FileNotFoundError:
            return None

    def close(self) -> None:
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)


def _step(graph, budget, device: str):
    """(Plan, Program) of one training step of `graph` under `budget` (None: no remat), without offload,
    through the planning entry autosp.plan uses."""
    from autosp.remat import plan_step
    plan, program, _, _ = plan_step(graph, budget, device=device, offload=False)
    return plan, program


@dataclass
class Priced:
    """A fixed program's step at one length, as the cost and memory models see it (picklable)."""
    values: np.ndarray      # bytes live at every point of the step (forward, then backward)
    saved: np.ndarray       # of which, the values the forward saves for the backward (on the device)
    comm: tuple[int, int]   # collective bytes sent per rank (comm_bytes)
    host: int               # bytes offloaded to host memory
    terms: np.ndarray       # the cost model's terms of every equation (_terms)
    shape: int = 0          # a hash of the program's shape (its equations' ops)

    def at(self, priced2: Priced, l1: int, l2: int, length: int, extra) -> tuple[float, float]:
        """(the step's peak, the saved bytes at that peak) at `length`, from this (at l1) and `priced2`
        (at l2): at the point where the peak falls at `length`, both affine in the length. `extra`:
        a function of the length added to the bytes at every point (the token ids)."""
        peak = Affine.fit(l1, self.values + extra(l1), l2, priced2.values + extra(l2))
        at = int(np.argmax(peak.a + peak.b * length))
        saved = _line(float(self.saved[at]), l1, float(priced2.saved[at]), l2).peak(length)
        return peak.peak(length), saved


def _profile(program, device: str) -> tuple[np.ndarray, np.ndarray, int]:
    """The bytes live at every point of the simulated step on `device`, those of the values saved for
    the backward at the same points, and a hash of the program's shape."""
    from autosp.remat import simulate_step
    mem = simulate_step(program, device, saved=True)
    values, saved = [], []
    for t in (mem.forward, mem.backward):
        values += [t.start, *t.during, t.end]
        saved += t.tracked
    shape = hash(tuple(e.op.name for g in (program.forward, program.backward) for e in g.eqns))
    return np.asarray(values, dtype=np.float64), np.asarray(saved, dtype=np.float64), shape


def _no_remat(graph, device: str) -> Priced:
    """A graph's no-remat step, priced."""
    _, program = _step(graph, None, device)
    return _priced(program, device)


def _priced(program, device: str) -> Priced:
    """A plan's program, priced."""
    values, saved, shape = _profile(program, device)
    made = {o.name: o for e in program.forward.eqns for o in e.outputs}
    return Priced(values, saved, comm_bytes(program), sum(made[n].nbytes() for n in program.offloaded if n in made),
                  _terms(program, device), shape)


def _terms(program, device: str) -> np.ndarray:
    """The cost model's terms (remat.cost.eqn_terms) of every equation of the step, forward then backward."""
    from autosp.remat.cost import device_for, eqn_terms
    dev = device_for(device)
    return np.asarray([eqn_terms(e, dev) for g in (program.forward, program.backward) for e in g.eqns],
                      dtype=np.float64).reshape(-1, 4)


def step_seconds(t1: np.ndarray, l1: int, t2: np.ndarray, l2: int, length: int, device: str) -> float:
    """The cost model's seconds of a fixed program's step at `length`, from its terms at l1 and l2: each
    equation's FLOPs are constant (a parameter's) or a L^2 + b L without a constant (a matmul's b L, causal
    attention's L (L + 1) / 2 per head), its bytes through memory and over the links affine in the length, its
    fixed seconds constant."""
    from autosp.remat.cost import device_for, terms_seconds
    fixed, f1, m1, k1 = t1.T
    _, f2, m2, k2 = t2.T
    # f / L = a L + b is affine in L
    g1, g2 = f1 / l1, f2 / l2
    grown = (g2 - g1) / (l2 - l1) * (length - l1) + g1
    f = np.where(f1 == f2, f1, grown * length)

    def affine(a, b):
        return a + (b - a) / (l2 - l1) * (length - l1)
    return float(np.sum(terms_seconds(fixed, f, affine(m1, m2), affine(k1, k2), device_for(device))))


@dataclass
class Probe:
    """What the two probe lengths tell (picklable: half of it comes from a forked process)."""
    profiles: dict          # (config, length) -> the no-remat step, Priced
    least: int              # the least peak found at the longer length
    plan: dict              # length -> that plan's program, Priced
    decisions: tuple        # that plan: (saved names, recomputed forward equations, offloaded names)
    offload_seconds: float  # that plan's host transfers at l2 (the cost model's), in proportion to their bytes
    tiling: tuple = ()      # that plan's tiled chains (Plan.tiling, at l2)
    method: str = "ILP"     # how that plan was found (Plan.method)


def _deepest(local, tiled: bool = True):
    """(chains, Chain.id -> k) of the tiling the probes plan with: every chain in as many tiles as lower its
    peak (tiling_levels' deepest; passes/tile.py's chains scale alike with the length); none if not `tiled`."""
    from autosp.passes.tile import find_chains
    from autosp.remat import tiling_levels
    chains = find_chains(local)
    return chains, (tiling_levels(chains)[-1] if tiled else {})


def probe_short(tracer, l1: int, l2: int, device: str):
    """The no-remat programs (no SP and SP) at both lengths. Each is differentiated once, at l1; at l2
    its joint is re-instantiated (remat.joint_of, passes/rescale.py), which costs a fraction of it."""
    from autosp.remat import joint_of
    profiles, joints = {}, {}
    for length in (l1, l2):
        p = tracer.trace(length)
        for key, graph in (("nosp", p.single), ("sp", p.local)):
            profiles[(key, length)] = _no_remat(graph, device)
            joints[(key, length)] = joint_of(graph)[1]
        if length == l1 and tracer.shared is not None and tracer.shared.parallel:
            _lend(tracer.shared, p.local)
    for key in ("nosp", "sp"):
        check_affine(signature(joints[(key, l1)].graph), l1, signature(joints[(key, l2)].graph), l2)
    return profiles


def _hand_over(shared, local, deep: dict) -> None:
    """The search's side of _Shared's replay joint: the joint of `local` (the step at l2) tiled `deep`, derived
    here first (kept by joint_of and _tiled, the search finds it) and handed over."""
    from autosp.passes.tile import find_chains
    from autosp.remat import _by_id, _tiled, export_joints, joint_of
    chains = find_chains(local)
    ks = _by_id(deep, chains)
    joint_of(_tiled(local, ks, chains) if ks else local)
    shared.put(shared.SEARCHED, (deep, export_joints()))


def _lend(shared, local1) -> None:
    """The short probe's side, once its programs at l1 are priced: if the search has handed its joint over by
    then, the step at l1 (`local1`) tiled as the search tiles, re-instantiated from it (remat.joint_of) and handed
    back with the joints derived here. Not later: the lend is in time only where the search outlasts a
    re-instantiation (the tiny preset's 1.5 s against 0.4 s), and one that begins later is not (the 8B step's 3.4
    s against 3 s, begun 2.5 s after the handover: the search replayed first and the lend's exchange cost 1 s)."""
    from autosp.passes.tile import find_chains, tile
    from autosp.remat import _by_id, adopt_joints, export_joints, joint_count, joint_of
    got = shared.get(shared.SEARCHED)
    if got is None:
        return
    deep, joints = got
    adopt_joints(joints)
    ks = _by_id(deep, find_chains(local1))
    before = joint_count()
    joint_of(tile(local1, ks) if ks else local1)
    shared.put(shared.LENT, export_joints(min(before, joint_count() - 1)))     # the one derived here


def probe_long(tracer, l1: int, l2: int, device: str, offload: bool, host_memory: int | None = None,
               fit=None, tiled: bool = True, host_bw: float | None = None):
    """The plan with the least peak found at l2 (its tiling of the position-wise chains included),
    replayed on the step at l1 (the same values saved, recomputed and offloaded): its price at both
    lengths. With offload under a host capacity the least-peak plan would
    fill the host at l2 and leave no room for longer lengths: each plan is priced at both lengths, and
    the host capacity it plans under at l2 is scaled by l2 / the length it reaches (`fit(priced) ->
    length`), for a few rounds; the longest wins."""
    from autosp.remat import _recomputed, adopt_joints, plan_step
    p = tracer.trace(l2, single=False)
    short = []          # the step at l1, traced (or handed over by the other process) when first needed

    chains, deepest = _deepest(p.local, tiled)
    deep = {c.name: deepest[c.id] for c in chains if c.id in deepest}
    tried = []
    shared = tracer.shared
    if shared is not None and shared.parallel:
        _hand_over(shared, p.local, deep)

    def least(cap):
        plan, program, joint, _ = plan_step(p.local, "least", device=device, offload=offload, refine=False,
                                            host_memory=cap, tiles=deep, host_bandwidth=host_bw)
        decisions = (program.saved, _recomputed(joint, program), program.offloaded)
        tiles = {name: k for name, k, _, _ in plan.tiling}
        priced2 = _priced(program, device)          # first: the replay's joint may be lent meanwhile (_Shared)
        if not short:
            short.append(tracer.trace(l1, single=False).local)
            lent = shared.get(shared.LENT) if shared is not None and shared.parallel else None
            if lent is not None:
                adopt_joints(lent)
        priced1, joint1 = _replay(short[0], decisions, tiles, device, plan.attention_backward)
        check_affine(signature(joint1.graph), l1, signature(joint.graph), l2)
        out = ((plan.peak_bytes, plan.offload_seconds, plan.tiling, plan.method), {l1: priced1, l2: priced2},
               decisions)
        tried.append(((fit or (lambda _: 0))(out[1]), out))
        return out

    if not (offload and host_memory and fit):
        return least(host_memory)

    def slopes(out):
        p1, p2 = out[1][l1], out[1][l2]
        dev = (float(np.max(p2.values)) - float(np.max(p1.values))) / (l2 - l1)    # device bytes per token
        return dev, (p2.host - p1.host) / (l2 - l1)                                # host bytes per token

    # A: nothing offloaded (the device alone, length L_A, d_A bytes per token). Offloading h bytes per
    # token lowers the device's to d(h); the longest length has the host full as the device is: with
    # d(h) on the line from A to a plan C that offloads (d_C, h_C), that is at L = L_A + H / h_C (1 - d_C
    # / d_A). A plan under the host capacity scaled to l2 / L at l2 fills the host at L: C first at twice
    # L_A, then at the length the line says
    d_a, _ = slopes(least(0))
    length_a = tried[0][0]
    target = 2 * max(length_a, l2)
    for _ in range(2):
        d_c, h_c = slopes(least(int(host_memory * l2 / target)))
        if h_c <= 0 or d_a <= 0 or d_c >= d_a:
            break
        nxt = length_a + host_memory / h_c * (1 - d_c / d_a)
        if abs(nxt - target) <= 0.02 * target:
            break
        target = nxt
    _, out = max(tried, key=lambda t: t[0])
    return out


def _replay(local1, decisions, tiles, device, attention: str = "sdpa"):
    """_priced of a plan made at another length (decisions, tiling by chain name, the attention backward's kernel)
    on the step `local1`, and that step's joint (re-instantiated from the other length's where it can be:
    remat.joint_of)."""
    from autosp.passes.tile import find_chains, tile
    from autosp.remat import _by_id, _joint
    from autosp.remat.apply import apply_plan
    joint1 = _joint(tile(local1, _by_id(tiles, find_chains(local1))) if tiles else local1, attention)[1]
    return _priced(apply_plan(joint1, *decisions), device), joint1


def _held_back(aff, length, step, avail, host_bytes, host_rank, ha, hb, l1, l2) -> str:
    """What stops the ILP row's length: the device (the plan's peak at the next length), or the host."""
    nxt = length + step
    over = aff.peak(nxt) - avail
    if host_rank is not None and hb > ha and _line(ha, l1, hb, l2).peak(nxt) > host_rank:
        return (f"held back by the host: at {nxt:,} its offloaded values would take "
                f"{fmt(_line(ha, l1, hb, l2).peak(nxt))}, more than the rank's {fmt(host_rank)}")
    return (f"held back by the device: at {nxt:,} the plan's peak would be {fmt(over)} over"
            + (f" (its host share holds {fmt(host_bytes)} of {fmt(host_rank)})" if host_rank else ""))


def _tiled_names(tiling) -> list[str]:
    """'loss in 64 tiles', 'mlp.0-31 in 4 tiles': Plan.tiling grouped by chain family and tiles."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name, k, _, _ in tiling:
        groups.setdefault((name.split(".")[0], k), []).append(name)
    out = []
    for (family, k), names in groups.items():
        idx = [n.split(".")[1] for n in names if "." in n]
        label = family if not idx else (f"{family}.{idx[0]}" if len(idx) == 1 else f"{family}.{idx[0]}-{idx[-1]}")
        out.append(f"{label} in {k} tiles")
    return out


def signature(graph) -> list:
    """(op, output shapes) of every equation, the inputs' shapes first: what two traces of one step
    at two lengths must share but for the lengths."""
    return [("input", tuple(v.shape for v in graph.inputs))] + \
        [(e.op.name, tuple(o.shape for o in e.outputs)) for e in graph.eqns]


class NotAffine(AutospError):
    """The step's program is not one program at two lengths (a Python loop along the sequence): its memory cannot
    be solved for from two traces; `autosp plan` then asks train's verdict at each length instead."""


def check_affine(a: list, l1: int, b: list, l2: int) -> None:
    """Raise unless `b` is the program `a` with at most one size of each value changed: sizes are affine
    in L (L, L / P, L + 1), so then every value's bytes are, and a program's bytes at every point."""
    def fail(why):
        raise NotAffine(f"autosp plan: {why}, so the step's memory is not affine in the length and cannot be "
                          f"solved for from two traces ({l1:,} and {l2:,} tokens). Fix: plan with autosp.plan at the "
                          "lengths you need (the Python API).")
    if [op for op, _ in a] != [op for op, _ in b]:
        raise NotAffine(
            f"autosp plan: the program has {len(a) - 1:,} equations at {l1:,} tokens and {len(b) - 1:,} at {l2:,}: the "
            "model runs a Python loop along the sequence (a recurrence's torch reference path: one pass per chunk "
            "or per position), so its memory cannot be solved for from two traces. Fix: run the model with its "
            "kernel declared as one op (autosp.sequence_op; autosp.kernels.sequence_ops declares fla's, "
            "mamba_ssm's and causal_conv1d's where they are installed), or plan one length at a time with "
            "--seq-len (fits or not, at that length's own trace).")
    for (op, xs), (_, ys) in zip(a, b):
        for x, y in zip(xs, ys):
            moved = [(d, e) for d, e in zip(x, y) if d != e]
            if len(x) != len(y) or len(moved) > 1:
                fail(f"a value of {op} has shape {list(x)} at {l1:,} tokens and {list(y)} at {l2:,}")


def probe(tracer, l1: int, l2: int, device: str, offload: bool, parallel: bool = True,
          host_memory: int | None = None, fit=None, tiled: bool = True, host_bw: float | None = None) -> Probe:
    """Both probe lengths: the no-remat programs here, the least-peak search at l2 (the slowest part) and
    its plan's replay on the step at l1 in a forked process, so that a fixed program is priced at both
    lengths (its bytes are affine in the length). Each process differentiates each of its programs once,
    at one length; the other length's joint is re-instantiated (remat.joint_of). Each SP step is traced
    once: by this process at l1, by the other at l2, each handing its trace to the other (_Shared)."""
    from autosp.remat import adopt_joints, export_joints
    shared = tracer.shared = _Shared(parallel)

    def search():
        out = probe_long(tracer, l1, l2, device, offload, host_memory, fit, tiled, host_bw)
        return out + ((export_joints() if parallel else None),)

    try:
        profiles, (found, priced, decisions, joints) = _both(lambda: probe_short(tracer, l1, l2, device), search,
                                                             parallel)
    finally:
        tracer.shared = None
        shared.close()
    if joints is not None:            # the search's (tiled) joints, for this process's checks at other lengths
        adopt_joints(joints)
    least, seconds, tiling, method = found
    return Probe(profiles, least, priced, decisions, seconds, tiling, method)


def _both(first, second, parallel: bool = True):
    """first() here and second() in a forked child at the same time (planning is single-threaded
    Python; a second core halves it); sequential where fork is not available. The side that ends first lends its
    core to the other's verdict (remat/helper.py: its next end searched beside it). The child's MIPs ended by their
    time limit count as this process's (solve.time_limits)."""
    import gc
    import pickle
    import shutil
    import tempfile

    from autosp.remat import solve
    from autosp.remat.helper import PEER_IDLE, child_answers
    if not parallel or not hasattr(os, "fork"):
        return first(), second()
    import scipy.optimize  # noqa: F401 - both sides solve MIPs: imported once, before the fork (solve.milp)
    # each side's end, as a file: the other side's verdict then searches its next end on the idle core (helper.py)
    folder = tempfile.mkdtemp(prefix="autosp-both-")
    first_done, second_done = os.path.join(folder, "first"), os.path.join(folder, "second")
    r, w = os.pipe()
    gc.freeze()             # the child's collections leave what it inherits unscanned (and its pages unshared)
    pid = os.fork()
    if pid != 0:
        gc.unfreeze()
    if pid == 0:                                      # the child: compute, send, leave without cleanup
        def ours():
            try:
                return second()
            finally:
                open(second_done, "w").close()
        try:
            os.close(r)
            PEER_IDLE[0] = first_done
        except BaseException:  # noqa: BLE001
            os._exit(1)
        child_answers(w, ours)
    os.close(w)
    before, PEER_IDLE[0] = PEER_IDLE[0], second_done
    try:
        a = first()
    finally:
        PEER_IDLE[0] = before
        open(first_done, "w").close()
        with os.fdopen(r, "rb") as f:
            data = f.read()
        os.waitpid(pid, 0)
        shutil.rmtree(folder, ignore_errors=True)
    if not data:
        raise AutospError("autosp plan: the planning subprocess died. Fix: rerun; if it persists, report it.")
    status, b, limited = pickle.loads(data)
    # the child's MIPs cut short by their time limit are this plan's: what it answers is then not kept (store.py)
    solve._LIMITED[0] += limited
    if status == "error":
        raise b
    return a, b


def comm_bytes(program) -> tuple[int, int]:
    """Bytes each rank sends in the step's collectives (recomputed ones included), by the size P of
    each one's group, as (the sequence's, the parameters'): all-to-all (P-1)/P of its input, ring
    all-reduce 2(P-1)/P, all-gather of the sequence (P-1) times its chunk, a halo exchange at most its halo;
    a parameter's gather (P-1) times its shard in the gathered dtype, its gradient's reduce-scatter (P-1)/P
    of the reduce_dtype buffer it sums (P shards). Needs the planning world (group sizes by name)."""
    from autosp.collectives import group_size
    seq = par = 0.0
    for g in (program.forward, program.backward):
        for e in g.eqns:
            name = e.op.name.split(".")[0]
            if name not in _COLLECTIVES:
                continue
            args = e.bind_schema()
            p = group_size(args["group_name"])
            if p <= 1:
                continue
            if name == "all_gather_param":
                par += (p - 1) * e.inputs[0].numel() * args["dtype"].itemsize
            elif name == "reduce_scatter_param":
                inner = math.prod(e.inputs[0].shape[1:])
                par += (p - 1) * args["chunk"] * inner * args["reduce_dtype"].itemsize
            elif name in ("halo_exchange", "halo_grad"):      # at most the halo (its positions or their grads)
                seq += e.outputs[0].nbytes() if name == "halo_exchange" else e.inputs[0].nbytes()
            else:
                size = sum(v.nbytes() for v in e.inputs)
                seq += {"all_to_all": (p - 1) / p, "all_reduce_sum": 2 * (p - 1) / p,
                        "all_gather_seq": p - 1}[name] * size
    return int(seq), int(par)


def ring_allreduce_bytes(nbytes: int, n: int) -> int:
    return int(2 * (n - 1) / n * nbytes) if n > 1 else 0


@dataclass
class Affine:
    """Bytes live at each point of a fixed program as a + b L (exact for these programs)."""
    a: np.ndarray
    b: np.ndarray

    @classmethod
    def fit(cls, l1: int, v1: np.ndarray, l2: int, v2: np.ndarray) -> Affine:
        b = (v2 - v1) / (l2 - l1)
        return cls(v1 - b * l1, b)

    def peak(self, length: int) -> float:
        return float(np.max(self.a + self.b * length))

    def longest(self, avail: float, step: int) -> int:
        """The largest multiple of `step` whose peak is at most `avail` (0 if none)."""
        grow = self.b > 0
        if np.any(self.a[~grow] > avail):
            return 0
        if not np.any(grow):
            return 1 << 62
        cap = float(np.min((avail - self.a[grow]) / self.b[grow]))
        n = int(math.floor(cap / step + 1e-9)) * step
        while n > 0 and self.peak(n) > avail:
            n -= step
        return max(n, 0)


def _guess(cfg, avail: float, dtype, sp: int, batch: int) -> float:
    """A rough SP no-remat length for `avail` bytes (a textbook count of a Llama layer's saved
    activations), only to place the two probe lengths near the answers; nothing depends on its accuracy."""
    h, n = cfg.hidden_size, cfg.num_hidden_layers
    f = getattr(cfg, "intermediate_size", 4 * h)
    per_token = (dtype.itemsize * n * (10 * h + 3 * f) + 12 * cfg.vocab_size) * batch / sp
    return max(0.0, avail) / per_token


def _secs(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _rounded(x: float, step: int) -> int:
    return int(x // step) * step


@dataclass
class Row:
    name: str
    length: int
    peak: float | None              # the step's peak at that length (per rank)
    comm: tuple[int, int] | None    # bytes sent per rank: (sequence collectives, parameter collectives)
    note: str = ""
    seconds: float | None = None    # the cost model's step time at that length (remat.cost)
    saved: float | None = None      # of the peak, the bytes saved by the forward for the backward
    host: int = 0                   # bytes offloaded to host memory per rank


def _line(a: float, l1: int, b: float, l2: int):
    """The affine function through (l1, a) and (l2, b)."""
    return Affine.fit(l1, np.array([a], dtype=np.float64), l2, np.array([b], dtype=np.float64))
