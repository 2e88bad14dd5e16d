"""Storage aliasing in the IR: which outputs of an equation are views sharing an input's storage,
and which value owns each storage. Read off the op schemas' alias annotations; the passes
(functionalize) and the memory model (remat) ask the same question here.
"""
from __future__ import annotations

import torch

from autosp.ir.core import Eqn, Graph, In, PerEqn

_VIEW_LIKE = {"_unsafe_view"}                   # no alias annotation, but a view of its input


def aliases(e: Eqn) -> list[int | None]:
    """For each output of `e`, the index of the input whose storage it shares (None: a new one)."""
    return _ALIASES.get(e, _aliases)


_ALIASES = PerEqn()     # simulations ask again and again


def _aliases(e: Eqn) -> list[int | None]:
    target = e.op.target
    n = len(e.outputs)
    if e.op.name in _VIEW_LIKE or e.op.name.split(".")[0] in _VIEW_LIKE:
        return [0] * n
    schema = getattr(target, "_schema", None)
    if schema is None or getattr(target, "namespace", None) == "autosp":
        return [None] * n
    # positions of tensor arguments among the equation's inputs, by schema argument: read off the
    # argument template (In(k) holes), not by binding it (this runs for every equation of every
    # program the planner simulates)
    arg_sets = {}
    spread = None                       # `Tensor(a -> *) self ... -> Tensor(a)[]`: a list of views of self
    args, kwargs = e.args, dict(e.kwargs)
    for i, a in enumerate(schema.arguments):
        val = args[i] if i < len(args) else kwargs.get(a.name)
        if a.alias_info is not None and isinstance(val, In):
            for s in a.alias_info.before_set:
                arg_sets.setdefault(s, e.inputs.index(e.inputs[val.k]))
            if "*" in a.alias_info.after_set:
                spread = e.inputs.index(e.inputs[val.k])
    out: list[int | None] = []
    rets = schema.returns
    if spread is not None and len(rets) == 1 and isinstance(rets[0].type, torch.ListType) and rets[0].alias_info:
        return [spread] * n
    for k in range(n):
        r = rets[min(k, len(rets) - 1)] if rets else None
        hit = None
        if r is not None and r.alias_info is not None:
            for s in r.alias_info.before_set:
                if s in arg_sets:
                    hit = arg_sets[s]
        out.append(hit)
    return out


def roots(graph: Graph) -> dict[str, str]:
    """Var name -> the name of the var that owns its storage (itself unless it is a view)."""
    root = {v.name: v.name for v in graph.inputs}
    root.update({v.name: v.name for v, _ in graph.consts})
    for e in graph.eqns:
        for v, a in zip(e.outputs, aliases(e)):
            root[v.name] = root[e.inputs[a].name] if a is not None else v.name
    return root
