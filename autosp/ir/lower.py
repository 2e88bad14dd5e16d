"""Lower a Graph to a torch.fx.GraphModule that computes the same flat outputs.

Lowering is where kernels are chosen: an attention equation runs autosp's flash kernel or SDPA as
`attention_kernel` decides for its shapes and device (by autosp.kernels.dispatch's measurements, which read
shapes alone: the kernels sit below the IR); every other equation calls its op.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autosp.ir.core import Eqn, Graph, Var

aten = torch.ops.aten


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
        if attention_kernel(eqn) == "flash":
            target, flash_args = flash_call(eqn, values)
            return g.call_function(operator.getitem, (g.call_function(target, flash_args), 0))
    return g.call_function(eqn.op.target, args, kwargs)


def attention_kernel(e: Eqn) -> str:
    """"flash" (autosp::flash_attention) or "sdpa" for an attention equation. Flash takes no mask
    tensor and no dropout, and runs only where it was measured faster (kernels.dispatch.flash_is_faster)."""
    if e.op.target is not aten.scaled_dot_product_attention.default:
        return "sdpa"
    b = e.bind_schema()
    if b["attn_mask"] is not None or b["dropout_p"]:
        return "sdpa"
    from autosp.kernels import dispatch         # here: importing the kernels registers their ops
    return "flash" if dispatch.flash_is_faster(e.inputs[0], bool(b["is_causal"])) else "sdpa"


def flash_call(e: Eqn, values) -> tuple:
    """(target, args) of the autosp::flash_attention call that computes SDPA equation `e` on `values`
    (its output 0 is SDPA's output; GQA needs no flag: fewer K/V heads are read as groups)."""
    import autosp.kernels  # noqa: F401 - registers torch.ops.autosp.flash_attention
    b = e.bind_schema(values)
    return (torch.ops.autosp.flash_attention.default,
            (b["query"], b["key"], b["value"], bool(b["is_causal"]), b["scale"], "auto"))


def _py_name(name: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in name)
    return out if out and not out[0].isdigit() else "v" + out
