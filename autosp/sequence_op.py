"""`autosp.sequence_op`: declare an opaque op as head-parallel along the sequence.

A fast kernel (flash-linear-attention's gated delta rule, mamba_ssm's SSD scan, causal_conv1d) is a
black box to a trace: make_fx cannot enter Triton or CUDA code, so autosp cannot find its sequence and
head dims itself. The user says them instead, one einops-style layout per tensor argument and output:

    @autosp.sequence_op(layouts="b s h dk, b s h dk, b s h dv, b s h, b s n, h -> b s h dv")
    def gated_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, c: Tensor, a: Tensor) -> Tensor:
        ...                                   # torch code, or a call into the kernel

`s` is the sequence, `h` the dim the op keeps independent (heads, channels; `split=` names another
letter). The layouts list the tensor arguments in order; other arguments (floats, ints, bools,
strings) pass through. The function must be annotated the way `torch.library.custom_op` reads it.

The declaration registers a `torch.library` custom op `autosp_seq::<name>` (one opaque equation in
every trace), with

- a fake: `fn` itself run on fake tensors (the reference's own shapes and strides), or, with
  `fake="layouts"`, empty outputs shaped by the layouts' letters (contiguous; the op's results are
  made contiguous to match), or a function of the op's arguments;
- a backward: a second custom op `autosp_seq::<name>_backward`, opaque as well, that runs
  `torch.func.vjp` of `fn`; `backward="autograd"` runs `fn` under autograd instead (a kernel with an
  autograd.Function of its own, which torch.func refuses), or a function
  `backward(grads, *args) -> one gradient per tensor argument (None where there is none)`.

The sharding pass (`passes/seqregions.py`, `declared_regions` below) makes each call a head-parallel
region of one equation: inputs with `s` and `h` are all-to-all'd to this rank's heads over the whole
sequence, inputs with `s` and no `h` (Mamba-2's B and C) are read whole, inputs with `h` and no `s`
(per-head parameters) are cut to this rank's heads, outputs go back sequence-sharded. The library
entry points autosp declares itself live in `autosp/kernels/sequence_ops.py`.
"""
from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Callable

import torch

from autosp.errors import AutospError, ShardError

NAMESPACE = "autosp_seq"


class SequenceOpError(AutospError):
    """A sequence op's declaration or call does not match its layouts."""


@dataclass(frozen=True, slots=True)
class Declaration:
    """What `sequence_op` was told about an op, read by the sharding pass."""
    name: str                              # autosp_seq::<name>
    ins: tuple[tuple[str, ...], ...]       # per tensor argument, its dims' letters
    outs: tuple[tuple[str, ...], ...]      # per output
    tensor_args: tuple[str, ...]           # the tensor arguments' names, in the layouts' order
    seq: str
    split: str

    def layouts(self) -> str:
        return f"{', '.join(' '.join(x) for x in self.ins)} -> {', '.join(' '.join(x) for x in self.outs)}"


_DECLARED: dict[object, Declaration] = {}          # forward OpOverload -> its declaration


def declaration(target) -> Declaration | None:
    """The declaration of an equation's op target, None for any other op."""
    return _DECLARED.get(getattr(target, "_opoverload", target))


# ---------------------------------------------------------------- layouts

def _parse_one(text: str, where: str, name: str) -> tuple[str, ...]:
    from einops import EinopsError
    from einops.parsing import ParsedExpression
    try:
        parsed = ParsedExpression(text)
    except EinopsError as exc:
        raise SequenceOpError(f"autosp.sequence_op {name}: the layout {text!r} of {where} does not parse: {exc}. "
                              "Fix: write one letter or name per dim, e.g. 'b s h d'.") from None
    if parsed.has_ellipsis or any(len(g) != 1 for g in parsed.composition):
        raise SequenceOpError(f"autosp.sequence_op {name}: the layout {text!r} of {where} groups or elides dims; "
                              "a sequence op names each dim once. Fix: write one name per dim, e.g. 'b s h d' "
                              "(no parentheses, no '...').")
    return tuple(g[0] for g in parsed.composition)


def parse_layouts(layouts, name: str) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """'x y, z -> w' or ((in, ...), out or (out, ...)) -> (inputs' letters, outputs' letters)."""
    if isinstance(layouts, str):
        if layouts.count("->") != 1:
            raise SequenceOpError(f"autosp.sequence_op {name}: layouts {layouts!r} has no single '->'. Fix: write "
                                  "the tensor arguments' layouts, '->', the outputs', e.g. 'b s h d, b s h -> b s h d'.")
        left, right = layouts.split("->")
        ins, outs = [t.strip() for t in left.split(",")], [t.strip() for t in right.split(",")]
    elif isinstance(layouts, (tuple, list)) and len(layouts) == 2:
        ins = list(layouts[0])
        outs = [layouts[1]] if isinstance(layouts[1], str) else list(layouts[1])
    else:
        raise SequenceOpError(f"autosp.sequence_op {name}: layouts must be 'ins -> outs' or (ins, outs), "
                              f"got {layouts!r}. Fix: e.g. layouts='b s h d, b s h -> b s h d'.")
    return ([_parse_one(t, f"tensor argument {i}", name) for i, t in enumerate(ins)],
            [_parse_one(t, f"output {i}", name) for i, t in enumerate(outs)])


def _check_letters(ins, outs, seq, split, name, layouts):
    said = f"autosp.sequence_op {name} (layouts {layouts!r})"
    if not any(seq in x for x in ins):
        raise SequenceOpError(f"{said}: no tensor argument has the sequence dim {seq!r}. Fix: name the sequence "
                              f"'{seq}' in the arguments' layouts, or pass seq='<its name>'.")
    if not any(split in x for x in ins):
        raise SequenceOpError(f"{said}: no tensor argument has the split dim {split!r} (the heads or channels the "
                              f"op keeps independent). Fix: name it '{split}', or pass split='<its name>'.")
    for i, letters in enumerate(outs):
        if seq not in letters or split not in letters:
            raise SequenceOpError(
                f"{said}: output {i} ({' '.join(letters)}) lacks the sequence dim {seq!r} or the split dim "
                f"{split!r}; each rank makes its heads of every position, so every output has both. Fix: "
                "return per-position, per-head values only (a final state is a second op).")


def _schema_args(schema: str) -> list[str]:
    """The argument declarations of a schema '(Tensor x, float s=1.0) -> Tensor', without defaults."""
    body = schema[schema.index("(") + 1:schema.rindex(") ->")]
    parts, depth, cur = [], 0, ""
    for ch in body:
        depth += ch in "([" and 1 or (-1 if ch in ")]" else 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.split("=")[0].strip() for p in parts if p.strip() and p.strip() != "*"]


# ---------------------------------------------------------------- the declaration

def sequence_op(fn: Callable | None = None, *, layouts, name: str | None = None, seq: str = "s", split: str = "h",
                fake: Callable | str | None = None, backward: Callable | str | None = None,
                flops: Callable | None = None):
    """Declare `fn` an op that mixes positions along the sequence and keeps `split` independent.

    Returns a callable with fn's signature that runs the custom op (differentiable). Usable as
    `@sequence_op(layouts=...)` or `sequence_op(fn, layouts=...)`. `flops(*args)` -> the forward's FLOPs
    (the backward is priced at twice that) lets the planner weigh it; without it the op counts as
    memory-bound. See the module docstring for `fake` and `backward`."""
    if fn is None:
        return functools.partial(sequence_op, layouts=layouts, name=name, seq=seq, split=split, fake=fake,
                                 backward=backward, flops=flops)
    name = name or re.sub(r"\W", "_", f"{fn.__module__}_{fn.__qualname__}").strip("_")
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise SequenceOpError(f"autosp.sequence_op: the name {name!r} is no identifier. Fix: pass name='my_scan'.")
    qual = f"{NAMESPACE}::{name}"
    if any(d.name == qual for d in _DECLARED.values()):
        raise SequenceOpError(f"autosp.sequence_op: {qual} is declared already. Fix: declare each function once "
                              "(at module level), or pass another name=.")
    ins, outs = parse_layouts(layouts, name)
    _check_letters(ins, outs, seq, split, name, layouts)
    try:
        schema = torch.library.infer_schema(fn, mutates_args=())
    except Exception as exc:  # noqa: BLE001 - torch says which annotation it cannot read
        raise SequenceOpError(f"autosp.sequence_op {name}: torch.library cannot read the signature of "
                              f"{fn.__qualname__}: {exc}. Fix: annotate every argument (torch.Tensor, float, int, bool, "
                              "str, Optional[...] of those) and the return (torch.Tensor or tuple[torch.Tensor, ...]).") from None
    params = list(inspect.signature(fn).parameters.values())
    decls = _schema_args(schema)
    tensors = [p.name for p, d in zip(params, decls) if d.split()[0] == "Tensor"]
    if any(d.split()[0] not in ("Tensor",) and d.split()[0].startswith("Tensor") for d in decls):
        raise SequenceOpError(f"autosp.sequence_op {name}: {schema}: optional or list tensor arguments have no "
                              "layout. Fix: make each tensor argument a plain torch.Tensor (wrap the kernel in a "
                              "function that passes None for the ones you do not use).")
    if len(tensors) != len(ins):
        raise SequenceOpError(f"autosp.sequence_op {name}: {len(ins)} argument layouts for {len(tensors)} tensor "
                              f"arguments ({', '.join(tensors)}) of {schema}. Fix: one layout per tensor argument, in order.")
    n_out = schema.split("->")[1].count("Tensor")
    if n_out != len(outs):
        raise SequenceOpError(f"autosp.sequence_op {name}: {len(outs)} output layouts for {n_out} outputs of "
                              f"{schema}. Fix: one layout per returned tensor.")
    decl = Declaration(qual, tuple(ins), tuple(outs), tuple(tensors), seq, split)
    tensor_pos = [i for i, p in enumerate(params) if p.name in tensors]
    others = [i for i in range(len(params)) if i not in tensor_pos]
    multi = len(outs) > 1 or schema.split("->")[1].strip().startswith("(")
    contiguous = fake == "layouts"

    @functools.wraps(fn)
    def impl(*args):
        out = fn(*args)
        res = tuple(out) if multi else (out,)
        # an output may not alias an argument (custom op rule); one shaped by the layouts is contiguous, as its fake
        res = tuple(o.contiguous() if contiguous else o for o in res)
        res = tuple(o.clone() if any(o.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
                                     for a in args if isinstance(a, torch.Tensor)) else o for o in res)
        return res if multi else res[0]

    op = torch.library.custom_op(qual, impl, mutates_args=(), schema=schema)
    if fake is None:
        op.register_fake(fn)
    elif fake == "layouts":
        op.register_fake(lambda *args: _fake_from_layouts(decl, [args[i] for i in tensor_pos], multi))
    elif callable(fake):
        op.register_fake(fake)
    else:
        raise SequenceOpError(f"autosp.sequence_op {name}: fake={fake!r}; it is None (run fn on fake tensors), "
                              "'layouts' or a function of the op's arguments.")

    other_decls = [decls[i] for i in others]
    bschema = f"({', '.join(['Tensor[] grads', 'Tensor[] tensors', *other_decls])}) -> Tensor[]"

    def merge(tensors_, rest):
        args = [None] * len(params)
        for i, t in zip(tensor_pos, tensors_):
            args[i] = t
        for i, v in zip(others, rest):
            args[i] = v
        return args

    def backward_impl(grads, tensors_, *rest):
        args = merge(tensors_, rest)
        wrt = [i for i, t in zip(tensor_pos, tensors_) if t.is_floating_point()]
        if callable(backward):
            got = backward(tuple(grads) if multi else grads[0], *args)
            got = [got[tensor_pos.index(i)] for i in wrt]
            got = [torch.zeros_like(args[i]) if g is None else g for i, g in zip(wrt, got)]
        elif backward == "autograd":
            got = _autograd_vjp(fn, args, wrt, grads, multi)
        else:
            def f(*xs):
                full = list(args)
                for i, x in zip(wrt, xs):
                    full[i] = x
                out = fn(*full)
                return tuple(out) if multi else out
            _, vjp = torch.func.vjp(f, *[args[i] for i in wrt])
            got = vjp(tuple(grads) if multi else grads[0])
        return [g.contiguous() for g in got]

    if backward is not None and backward != "autograd" and not callable(backward):
        raise SequenceOpError(f"autosp.sequence_op {name}: backward={backward!r}; it is None (torch.func.vjp of fn), "
                              "'autograd' or a function backward(grads, *args).")
    bop = torch.library.custom_op(f"{qual}_backward", backward_impl, mutates_args=(), schema=bschema)
    bop.register_fake(lambda grads, tensors_, *rest: [t.new_empty(t.shape) for t in tensors_ if t.is_floating_point()])

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*[inputs[i] for i in tensor_pos])
        ctx.rest = [inputs[i] for i in others]

    def grad(ctx, *grads):
        saved = ctx.saved_tensors
        with torch.no_grad():   # the backward op has no derivative of its own (no double backward)
            got = iter(bop(list(grads), list(saved), *ctx.rest))
        per = [None] * len(params)
        for i, t in zip(tensor_pos, saved):
            per[i] = next(got) if t.is_floating_point() else None
        return tuple(per)

    from autosp.kernels._ops import differentiable
    call = differentiable(op, setup_context, grad)
    _DECLARED[op._opoverload] = decl
    _register_links(op, decl)
    if flops is not None:
        _register_flops(op, bop, flops, tensor_pos, others, len(params))
    return SequenceOp(fn, call, decl, inspect.signature(fn), tensor_pos, op)


def _autograd_vjp(fn, args, wrt, grads, multi):
    """fn's gradient by autograd, inside a custom op's kernel: there autograd's dispatch keys are excluded
    (torch runs kernels below autograd), so they are let back in for this computation alone."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
    for k in (torch._C.DispatchKey.AutogradOther, torch._C.DispatchKey.AutogradNestedTensor,
              torch._C.DispatchKey.ADInplaceOrView):
        keys = keys | torch._C.DispatchKeySet(k)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                         torch._C._dispatch_tls_local_exclude_set() - keys), torch.enable_grad():
        full = list(args)
        for i in wrt:
            full[i] = args[i].detach().requires_grad_(True)
        out = fn(*full)
        outs = list(out) if multi else [out]
        got = torch.autograd.grad(outs, [full[i] for i in wrt], list(grads), allow_unused=True)
    return [torch.zeros_like(args[i]) if g is None else g for i, g in zip(wrt, got)]


def _fake_from_layouts(decl: Declaration, tensors, multi):
    sizes, first = {}, None
    for letters, t in zip(decl.ins, tensors):
        sizes.update(zip(letters, t.shape))
        if first is None and t.is_floating_point():
            first = t
    missing = [c for o in decl.outs for c in o if c not in sizes]
    if missing:
        raise SequenceOpError(f"autosp.sequence_op {decl.name}: fake='layouts' cannot size the outputs: "
                              f"{', '.join(missing)} appear in no argument's layout ({decl.layouts()}). "
                              "Fix: pass fake=<a function of the arguments that returns empty outputs>.")
    outs = tuple(first.new_empty([sizes[c] for c in o]) for o in decl.outs)
    return outs if multi else outs[0]


def _register_links(op, decl: Declaration) -> None:
    """seqdims' link rule for the op: a letter an argument shares with an output is the same dim."""
    from autosp.ir.ops import op_for
    from autosp.passes.seqdims import LINK_RULES, dim_link

    def links(e):
        b = e.bind_schema()
        res = []
        for name, letters in zip(decl.tensor_args, decl.ins):
            x = b.get(name)
            if x is None or not hasattr(x, "ndim"):
                continue
            for out, oletters in zip(e.outputs, decl.outs):
                res.append(dim_link(x, out, {i: oletters.index(c) for i, c in enumerate(letters) if c in oletters}))
        return res
    LINK_RULES[op_for(op._opoverload).name] = links


def _register_flops(op, bop, flops, tensor_pos, others, n):
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(op._opoverload.overloadpacket)
    def _fwd(*args, out_val=None, **kwargs):
        return int(flops(*args))

    @register_flop_formula(bop._opoverload.overloadpacket)
    def _bwd(grads, tensors, *rest, out_val=None, **kwargs):
        args = [None] * n
        for i, t in zip(tensor_pos, tensors):
            args[i] = t
        for i, v in zip(others, rest):
            args[i] = v
        return 2 * int(flops(*args))


class SequenceOp:
    """A declared sequence op: call it like fn (checked against its layouts), differentiably."""

    def __init__(self, fn, call, decl, signature, tensor_pos, op):
        self.fn, self._call, self.declaration, self._sig, self._tensor_pos, self.op = fn, call, decl, signature, tensor_pos, op
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        try:
            bound = self._sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise SequenceOpError(f"autosp.sequence_op {self.declaration.name}: {exc}. Fix: call it as "
                                  f"{self.fn.__qualname__}{self._sig}.") from None
        bound.apply_defaults()
        full = list(bound.arguments.values())
        check_shapes(self.declaration, [full[i] for i in self._tensor_pos])
        return self._call(*full)

    def __repr__(self):
        return f"<autosp.sequence_op {self.declaration.name}: {self.declaration.layouts()}>"


def check_shapes(decl: Declaration, tensors) -> dict[str, int]:
    """Each tensor argument has its layout's rank, and a letter has one size everywhere."""
    sizes: dict[str, tuple[int, str]] = {}
    for name, letters, t in zip(decl.tensor_args, decl.ins, tensors):
        if not isinstance(t, torch.Tensor):
            raise SequenceOpError(f"autosp.sequence_op {decl.name}: argument {name} is {type(t).__name__}, its "
                                  f"layout {' '.join(letters)!r} says a tensor. Fix: pass a tensor.")
        if t.ndim != len(letters):
            raise SequenceOpError(
                f"autosp.sequence_op {decl.name}: argument {name} has shape {list(t.shape)} ({t.ndim} dims) but "
                f"its layout {' '.join(letters)!r} names {len(letters)} (layouts {decl.layouts()}). Fix: declare "
                f"one name per dim of {name}, or pass it in the declared layout.")
        for c, n in zip(letters, t.shape):
            if c in sizes and sizes[c][0] != n:
                raise SequenceOpError(
                    f"autosp.sequence_op {decl.name}: dim {c!r} is {sizes[c][0]} in {sizes[c][1]} but {n} in {name} "
                    f"(shape {list(t.shape)}; layouts {decl.layouts()}). Fix: give dims of different sizes "
                    "different names (e.g. dk and dv).")
            sizes.setdefault(c, (n, name))
    return {c: n for c, (n, _) in sizes.items()}


# ---------------------------------------------------------------- the sharding pass's view

def declared_regions(graph, pos, heavy, length: int, ranks: int, skip=frozenset()) -> list:
    """One head-parallel region (seqregions.SeqRegion) per call of a declared sequence op in a global graph."""
    from autosp.passes.seqdims import SeqPos
    from autosp.passes.seqregions import SeqRegion
    _, readers, outputs = graph.index()
    regions = []
    for k, e in enumerate(graph.eqns):
        decl = declaration(e.op.target)
        if decl is None or k in skip:
            continue
        b = e.bind_schema()
        head, entries = {}, []
        shapes = ", ".join(f"{n} {list(b[n].shape)}" for n in decl.tensor_args)
        for name, letters in zip(decl.tensor_args, decl.ins):
            x = b[name]
            if decl.seq in letters:
                d = letters.index(decl.seq)
                if x.shape[d] != length:
                    raise ShardError(
                        f"autosp.shard: {decl.name} at {e.source or '<no source line>'}: argument {name} "
                        f"{list(x.shape)} has {x.shape[d]} positions in its sequence dim {decl.seq!r} (layouts "
                        f"{decl.layouts()}), the sequence is {length}. Fix: declare the dim that holds the sequence "
                        f"as {decl.seq!r}, or pass the whole sequence.")
                if x.name in heavy:
                    entries.append(x.name)
            if decl.split in letters:
                head[x.name] = SeqPos(letters.index(decl.split))
        for out, letters in zip(e.outputs, decl.outs):
            head[out.name] = SeqPos(letters.index(decl.split))
        n_heads = max(b[n].shape[letters.index(decl.split)]
                      for n, letters in zip(decl.tensor_args, decl.ins) if decl.split in letters)
        if n_heads % ranks:
            raise ShardError(
                f"autosp.shard: {decl.name} at {e.source or '<no source line>'} splits its dim {decl.split!r} "
                f"({n_heads}) over sp={ranks}, which does not divide it (shapes {shapes}; layouts {decl.layouts()}). "
                f"Fix: use an sp size that divides {n_heads} (or give the op a multiple of {ranks} "
                f"{decl.split!r}), or keep this op's sequence whole (sp=1).")
        exits = {o.name for o in e.outputs if o.name in outputs or readers.get(o.name)}
        regions.append(SeqRegion(frozenset({k}), head, frozenset(entries), frozenset(exits), n_heads))
    return regions
