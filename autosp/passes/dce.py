"""Dead-code elimination: drop equations whose results nothing uses (Graph -> Graph).

Equations with no outputs (grad-mode switches) and in-place ops are kept. Unused collectives go
too: every rank runs the same graph, so they disappear on all ranks alike.
"""
from __future__ import annotations

from autosp.ir.core import Graph, Var
from autosp.ir.ops import Tag


def dce(graph: Graph) -> Graph:
    live = {o.name for o in graph.outputs if isinstance(o, Var)}
    kept = []
    for e in reversed(graph.eqns):
        needed = not e.outputs or e.op.has(Tag.INPLACE) or any(o.name in live for o in e.outputs)
        if needed:
            kept.append(e)
            live.update(v.name for v in e.inputs)
    used = live
    consts = tuple((v, t) for v, t in graph.consts if v.name in used)
    return graph.replace(eqns=tuple(reversed(kept)), consts=consts)
