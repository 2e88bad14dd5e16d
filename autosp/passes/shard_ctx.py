"""The state of one sharding rewrite: the new graph being built, fake values, layouts, the mesh.

Rules (in shard_rules.py) read the old equation and emit new ones through `ShardCtx.emit`,
which runs the op on fake tensors to type its outputs, so every emitted equation is typed
by the op itself and the rewrite can check local shapes as it goes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autosp import collectives as C
from autosp.errors import ShardError
from autosp.ir.core import Eqn, Graph, Var, map_args
from autosp.ir.ops import op_for
from autosp.layout import Layout
from autosp.passes.seqdims import SeqPos


_MISSING = object()


def _static(out) -> bool:
    """Whether an op's fake outputs are all of static shapes (none data-dependent): only those are reused."""
    outs = out if isinstance(out, (tuple, list)) else [out]
    return all(not isinstance(x, torch.Tensor) or all(isinstance(d, int) for d in x.shape) for x in outs) and \
        not any(isinstance(x, torch.SymInt) for x in outs)


@dataclass
class MeshInfo:
    sp_size: int
    sp_group: str
    dp_size: int = 1
    dp_group: str | None = None
    sp_ranks: tuple[tuple[int, ...], ...] = ()   # every sp group's global ranks (for sub-groups: the ring)
    ring: int | None = None                      # ring size R forced by the caller (None: autosp factorises)

    @property
    def grad_groups(self) -> tuple[str, ...]:
        return (self.sp_group,) + ((self.dp_group,) if self.dp_group else ())


@dataclass
class ShardCtx:
    mesh: MeshInfo
    chunk: int                                   # local sequence length: ceil(L / P)
    pos: dict[str, SeqPos]                       # old var name -> its sequence position
    heavy: set[str]                              # old var names that are activations
    env: dict[str, Var] = field(default_factory=dict)      # old name -> new var
    eqns: list[Eqn] = field(default_factory=list)
    fakes: dict[str, object] = field(default_factory=dict)
    fake_mode: FakeTensorMode = field(default_factory=lambda: FakeTensorMode(allow_non_fake_inputs=True))
    rep: dict[str, Var] = field(default_factory=dict)      # old name -> its replicated new var, when known
    graph: Graph | None = None                   # the global graph being rewritten
    input_free: set[str] = field(default_factory=set)     # old names computable without the inputs
    producer: dict[str, Eqn] = field(default_factory=dict)  # old name -> the global equation defining it
    counter: int = 0
    _cache: dict = field(default_factory=dict)
    _typed: dict = field(default_factory=dict)     # _typing_key -> the op's outputs on fakes

    # ------------------------------------------------------------ building
    def fresh(self) -> str:
        self.counter += 1
        return str(self.counter - 1)

    def emit(self, target, args, kwargs=None, *, source=None, layouts=None):
        """Append target(*args, **kwargs) (Vars inside) and return its output Var(s)."""
        kwargs = kwargs or {}
        key = self._typing_key(target, args, kwargs)
        out = self._typed.get(key, _MISSING) if key is not None else _MISSING
        if out is _MISSING:
            fake = lambda x: self.fakes[x.name] if isinstance(x, Var) else x
            fargs, fkw = map_args(fake, args), map_args(fake, kwargs)
            with self.fake_mode:
                out = target(*fargs, **fkw)
            if key is not None and _static(out):
                self._typed[key] = out
        multi = isinstance(out, (tuple, list))
        outs_raw = list(out) if multi else ([] if out is None else [out])
        layouts = list(layouts) if layouts is not None else [None] * len(outs_raw)
        outs = []
        for x, lay in zip(outs_raw, layouts):
            if isinstance(x, torch.Tensor):
                v = Var(self.fresh(), x.dtype, tuple(x.shape), str(x.device), layout=lay)
            else:
                v = Var(self.fresh(), None, ())
            self.fakes[v.name] = x
            outs.append(v)
        self.eqns.append(Eqn.make(op_for(target), args, kwargs, outs, multi=multi, source=source))
        if multi:
            return tuple(outs)
        return outs[0] if outs else None

    def _typing_key(self, target, args, kwargs):
        """What `target`'s outputs' types are a function of: the op, its arguments, and each tensor argument's
        dtype, device, shape, strides and offset (the fakes' metadata, not their identity). A model's repeated
        layers emit the same equations on values of the same types, so each is run on fakes once (half of the
        sharding pass's time); None where an argument cannot be keyed (a symbolic size)."""
        def key(x):
            if isinstance(x, Var):
                f = self.fakes[x.name]
                if isinstance(f, torch.Tensor):
                    return (f.dtype, f.device, tuple(f.shape), f.stride(), f.storage_offset())
                return ("value", f)
            if isinstance(x, (list, tuple)):
                return (type(x), tuple(key(y) for y in x))
            if isinstance(x, dict):
                return (dict, tuple((k, key(v)) for k, v in x.items()))
            return (type(x), x)
        if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
            return None                         # an op that changes its inputs (their metadata too) runs each time
        try:
            k = (target, key(args), key(kwargs))
            hash(k)
        except TypeError:                       # a SymInt, an unhashable argument: typed by running the op
            return None
        return k

    # ------------------------------------------------------------ layouts
    def layout_for(self, old: Var, length: int | None = None) -> Layout | None:
        p = self.pos.get(old.name)
        if p is None:
            return None
        glen = p.length(old)
        return Layout(p.dim, min(glen, length) if length is not None else glen, self.chunk, p.outer, p.inner)

    def wants_shard(self, old: Var) -> bool:
        return old.name in self.heavy and old.name in self.pos and old.dtype is not None

    def check_fits(self, old: Var, where: str):
        p = self.pos[old.name]
        if p.length(old) > self.chunk * self.mesh.sp_size:
            raise ShardError(
                f"{where}: the sequence dim {p.dim} of {old} ({old.type_str()}) has {p.length(old)} positions, "
                f"more than attention's {self.chunk * self.mesh.sp_size} (padded for sp={self.mesh.sp_size}). "
                "Fix: pass in_specs naming the sequence dim of each input.")

    def constant_value(self, old: Var):
        """The real value of an input-free global var (evaluated once), or None if not computable."""
        if old.name not in self.input_free or self.graph is None:
            return None
        key = ("const", old.name)
        if key not in self._cache:
            env = {v.name: t for v, t in self.graph.consts}
            if any(t.device.type == "meta" for t in env.values()):
                self._cache[key] = None
                return None
            needed = {old.name}
            eqns = []
            for e in reversed(self.graph.eqns):
                if any(o.name in needed for o in e.outputs):
                    eqns.append(e)
                    needed.update(x.name for x in e.inputs)
            for e in reversed(eqns):
                args, kwargs = e.bind([env[x.name] for x in e.inputs])
                out = e.op.target(*args, **kwargs)
                for v, x in zip(e.outputs, out if e.multi else [out]):
                    env[v.name] = x
            self._cache[key] = env[old.name]
        return self._cache[key]

    # ------------------------------------------------------------ collectives and helpers
    def shard(self, new: Var, old: Var, source=None) -> Var:
        """R -> S: this rank's chunk of a replicated value (cached per value)."""
        key = ("shard", new.name)
        if key not in self._cache:
            self.check_fits(old, source or "shard")
            lay = self.layout_for(old)
            self._cache[key] = self.emit(C.shard_slice, (new, lay.dim, lay.outer, lay.chunk, lay.inner,
                                                        self.mesh.sp_group), source=source, layouts=[lay])
        return self._cache[key]

    def gather(self, new: Var, source=None) -> Var:
        """S -> R: the exact fallback; the global value (padding dropped) on every rank."""
        key = ("gather", new.name)
        if key not in self._cache:
            lay = new.layout
            self._cache[key] = self.emit(C.all_gather_seq, (new, lay.length, lay.dim, lay.outer, lay.chunk,
                                                           lay.inner, self.mesh.sp_group), source=source)
        return self._cache[key]

    def valid_mask(self, new: Var) -> Var | None:
        """Bool mask, broadcastable to `new`, of positions < the layout's valid length (None: all valid)."""
        lay: Layout = new.layout
        if lay.length >= lay.chunk * self.mesh.sp_size:
            return None
        key = ("valid", new.ndim, lay)
        if key not in self._cache:
            aten = torch.ops.aten
            pos = self.emit(C.local_positions, (lay.chunk, self.mesh.sp_group, torch.device(new.device)))
            ok = self.emit(aten.lt.Scalar, (pos, lay.length))
            ok = self.emit(aten.view.default, (ok, [1, lay.chunk, 1]))
            ok = self.emit(aten.expand.default, (ok, [lay.outer, lay.chunk, lay.inner]))
            ok = self.emit(aten.reshape.default, (ok, [lay.local_size()]))
            shape = [1] * new.ndim
            shape[lay.dim] = lay.local_size()
            self._cache[key] = self.emit(aten.view.default, (ok, shape))
        return self._cache[key]

    def as_sharded(self, old: Var, source=None) -> Var:
        """The new value of `old`, sharded if it has a sequence dim and is replicated now.

        A replicated value made by a position-wise op from replicated values (RoPE's cos and
        sin, unsqueezed once per layer) is rebuilt from its sharded inputs instead: the shard
        moves up the chain, so each source is sliced once and the chain runs on s/P positions.
        """
        new = self.env[old.name]
        if new.layout is not None or old.name not in self.pos or new.dtype is None:
            return new
        from autosp.passes.shard_rules import positionwise, rule_for
        e = self.producer.get(old.name)
        if (e is not None and len(e.outputs) == 1 and rule_for(e) is positionwise
                and any(x.name in self.pos for x in e.inputs) and old.name not in self.heavy):
            self.rep[old.name] = new
            positionwise(self, e, force=True)
            if self.env[old.name].layout is not None:
                return self.env[old.name]
            self.env[old.name] = new
        return self.shard(new, old, source)

    def as_replicated(self, old: Var, source=None) -> Var:
        new = self.env[old.name]
        if new.layout is None:
            return new
        if old.name not in self.rep:
            self.rep[old.name] = self.gather(new, source)
        return self.rep[old.name]
