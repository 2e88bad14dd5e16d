"""Run a Graph on real tensors: the reference semantics every pass must keep."""
from __future__ import annotations

from torch.utils import _pytree as pytree

from autosp.ir.core import Graph, Var


def eval_graph(graph: Graph, *flat_args, consts=None):
    """Evaluate on flat inputs; returns the flat outputs."""
    env: dict[str, object] = {}

    def read(v):
        return env[v.name] if isinstance(v, Var) else v

    def write(v: Var, x):
        env[v.name] = x

    for v, x in zip(graph.inputs, flat_args, strict=True):
        write(v, x)
    for v, t in consts if consts is not None else graph.consts:
        write(v, t)
    for eqn in graph.eqns:
        args, kwargs = eqn.bind([read(v) for v in eqn.inputs])
        out = eqn.op.target(*args, **kwargs)
        if eqn.multi:
            for v, x in zip(eqn.outputs, out):
                write(v, x)
        elif eqn.outputs:
            write(eqn.outputs[0], out)
    return [read(o) for o in graph.outputs]


def flatten_inputs(graph: Graph, args) -> list:
    """The tensor leaves of `args` in the graph's input order (static leaves dropped)."""
    leaves, spec = pytree.tree_flatten(tuple(args))
    if graph.in_spec is not None and spec != graph.in_spec:
        from autosp.errors import AutospError
        raise AutospError(
            f"the arguments do not match the traced signature: expected {graph.in_spec}, got {spec}. "
            "Fix: call with the same structure as when traced, or trace again.")
    static = {i for i, _ in graph.static_args}
    return [x for i, x in enumerate(leaves) if i not in static]


def call_graph(graph: Graph, *args):
    """graph(*args): same pytree in, same pytree out as the traced function."""
    outs = eval_graph(graph, *flatten_inputs(graph, args))
    return pytree.tree_unflatten(outs, graph.out_spec) if graph.out_spec is not None else outs
