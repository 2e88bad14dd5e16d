"""verify(graph): SSA, then dtypes and shapes re-derived by running each op on fake tensors."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autosp.errors import VerifyError
from autosp.ir.core import Graph, Var


def verify(graph: Graph, *, shapes: bool = True) -> Graph:
    """Raise VerifyError with the bad equation in context; return the graph unchanged."""
    defined: set[str] = set()

    def define(v: Var, where: int):
        if v.name in defined:
            _fail(graph, where, f"{v} is defined twice (SSA)")
        defined.add(v.name)

    for v in graph.inputs:
        define(v, -1)
    for v, t in graph.consts:
        define(v, -1)
        if tuple(t.shape) != v.shape or t.dtype != v.dtype:
            _fail(graph, -1, f"constant {v} is {t.dtype}{list(t.shape)}, declared {v.type_str()}")
    for i, e in enumerate(graph.eqns):
        for v in e.inputs:
            if v.name not in defined:
                _fail(graph, i, f"{v} is used before it is defined")
        for v in e.outputs:
            define(v, i)
    for o in graph.outputs:
        if isinstance(o, Var) and o.name not in defined:
            _fail(graph, len(graph.eqns), f"output {o} is not defined")
    if shapes:
        _check_types(graph)
    return graph


def _check_types(graph: Graph) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    env: dict[str, object] = {}
    with mode:
        for v in graph.inputs:
            env[v.name] = torch.empty(v.shape, dtype=v.dtype, device=_device(v))
        for v, t in graph.consts:
            env[v.name] = mode.from_tensor(t)
        for i, e in enumerate(graph.eqns):
            args, kwargs = e.bind([env[v.name] for v in e.inputs])
            try:
                out = e.op.target(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - report which equation broke
                _fail(graph, i, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            outs = list(out) if e.multi else ([out] if e.outputs else [])
            if len(outs) != len(e.outputs):
                _fail(graph, i, f"op returned {len(outs)} values, equation declares {len(e.outputs)}")
            for v, x in zip(e.outputs, outs):
                if isinstance(x, torch.Tensor):
                    if v.dtype != x.dtype or v.shape != tuple(x.shape):
                        got = f"{x.dtype}{list(x.shape)}"
                        _fail(graph, i, f"{v} is declared {v.type_str()} but the op gives {got}")
                elif v.dtype is not None:
                    _fail(graph, i, f"{v} is declared a tensor but the op gives {type(x).__name__}")
                env[v.name] = x


def _device(v: Var):
    return torch.device(v.device) if v.device != "meta" else torch.device("meta")


def _fail(graph: Graph, i: int, why: str):
    lines = str(graph).splitlines()
    # the printed graph has 2 header lines and one line per const before the equations
    row = 2 + len(graph.consts) + i if i >= 0 else 1
    lo, hi = max(0, row - 3), min(len(lines), row + 4)
    ctx = "\n".join(("> " if j == row else "  ") + lines[j] for j in range(lo, hi))
    raise VerifyError(f"ir.verify({graph.name}): {why}\n{ctx}")
