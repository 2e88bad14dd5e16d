"""Lower a Graph to a torch.fx.GraphModule that computes the same flat outputs.

Lowering is where kernels are chosen: an attention equation runs autosp's flash kernel or SDPA as
autosp.kernels.dispatch decides for its shapes and device; every other equation calls its op.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autosp.ir.core import Graph, Var


def lower(graph: Graph) -> fx.GraphModule:
    """One fx node per equation (plus getitems for multi-output ops)."""
    root = torch.nn.Module()
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    for v in graph.inputs:
        env[v.name] = g.placeholder(_py_name(v.name))
    for i, (v, t) in enumerate(graph.consts):
        attr = f"_const{i}"
        setattr(root, attr, t)
        env[v.name] = g.get_attr(attr)
    for eqn in graph.eqns:
        args, kwargs = eqn.bind([env[v.name] for v in eqn.inputs])
        node = _call(g, eqn, [env[v.name] for v in eqn.inputs], args, kwargs)
        if eqn.source:
            node.meta["stack_trace"] = eqn.source
        if eqn.multi:
            for i, v in enumerate(eqn.outputs):
                env[v.name] = g.call_function(operator.getitem, (node, i))
        elif eqn.outputs:
            env[eqn.outputs[0].name] = node
    g.output(tuple(env[o.name] if isinstance(o, Var) else o for o in graph.outputs))
    gm = fx.GraphModule(root, g, class_name=f"autosp_{_py_name(graph.name)}")
    return gm


def _call(g: fx.Graph, eqn, values, args, kwargs) -> fx.Node:
    if eqn.op.name == "attention":
        from autosp.kernels.dispatch import attention_kernel, flash_call
        if attention_kernel(eqn) == "flash":
            target, flash_args = flash_call(eqn, values)
            return g.call_function(operator.getitem, (g.call_function(target, flash_args), 0))
    return g.call_function(eqn.op.target, args, kwargs)


def _py_name(name: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in name)
    return out if out and not out[0].isdigit() else "v" + out
