"""Issue each parameter gather a layer ahead of its first use (Graph -> Graph).

The sharding pass emits every `all_gather_param` at the graph's start, which would hold the whole
model gathered through the forward. This pass moves them: the parameters of one layer (the name up
to its first numeric component, `params.model.layers.3`; any other parameter is its own group)
are gathered together, right before the first use of the layer before them, so one layer's
gather is in flight while the previous layer computes and at most two layers are gathered at once
(what they are kept for after that is the remat plan's choice: save or gather again).
"""
from __future__ import annotations

import re

from autosp.ir.core import Graph, Var

_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")


def layer_of(name: str) -> str:
    """The group a parameter is gathered with: its name up to the first numeric component."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


def schedule_gathers(graph: Graph) -> Graph:
    gathers = [e for e in graph.eqns if e.op.name == "all_gather_param"]
    if not gathers:
        return graph
    rest = [e for e in graph.eqns if e.op.name != "all_gather_param"]
    n = len(rest)
    first: dict[str, int] = {}
    made: dict[str, int] = {}
    for i, e in enumerate(rest):
        for x in e.inputs:
            first.setdefault(x.name, i)
        for o in e.outputs:
            made[o.name] = i
    for o in graph.outputs:
        if isinstance(o, Var):
            first.setdefault(o.name, n)
    source = {v.name: v.name for v in graph.inputs}
    for e in rest:                               # grad_sync(param) -> the param's name
        if e.op.name == "grad_sync" and e.inputs[0].name in source:
            source[e.outputs[0].name] = source[e.inputs[0].name]
    groups: dict[str, list] = {}
    for g in gathers:
        groups.setdefault(layer_of(source.get(g.inputs[0].name, g.inputs[0].name)), []).append(g)
    use = {k: min(first.get(g.outputs[0].name, n) for g in gs) for k, gs in groups.items()}
    at: dict[int, list] = {}
    previous = None
    for key in sorted(groups, key=lambda k: use[k]):
        pos = use[key] if previous is None else previous
        for g in groups[key]:                    # never before the value it gathers exists
            at.setdefault(max(pos, made.get(g.inputs[0].name, -1) + 1), []).append(g)
        previous = use[key]
    eqns = []
    for i, e in enumerate(rest):
        eqns.extend(at.pop(i, ()))
        eqns.append(e)
    eqns.extend(g for i in sorted(at) for g in at[i])
    return graph.replace(eqns=tuple(eqns), name="schedule_gathers")
