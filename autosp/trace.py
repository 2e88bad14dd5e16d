"""autosp.trace: a function and example arguments -> ir.Graph, via make_fx over fake tensors.

Parameters are inputs (JAX-style). Tensors the function closes over (module
buffers such as RoPE's `inv_freq`) become graph constants. Non-tensor leaves
(ints, floats, bools, None, strings, dtypes) are baked in as static arguments.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import operator
import os
import traceback

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from autosp.decompositions import trace_decompositions
from autosp.errors import TraceError
from autosp.ir.core import Eqn, Graph, Role, Var
from autosp.ir.ops import op_for

_DATA_DEPENDENT = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
_STATIC_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device)
_TORCH_DIR = os.path.dirname(torch.__file__)
# make_fx learned record_stack_traces after torch 2.5; older versions trace without source lines
_STACK_TRACES = ({"record_stack_traces": True}
                 if "record_stack_traces" in inspect.signature(make_fx).parameters else {})
_SOURCES = contextvars.ContextVar("autosp_trace_sources", default=True)


def uncompiled():
    """make_fx's GraphModules without their Python code (torch's lazy graph modules): autosp lifts the
    graph and never calls the module, and generating and compiling the code of a 20,000-equation joint
    took a second (bench/RESULTS.md). A no-op on a torch without them."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


@contextlib.contextmanager
def without_sources():
    """Trace without each equation's source line (Eqn.source, which errors quote): make_fx's stack
    traces are a tenth of a large model's trace. For callers that retrace with them on an error
    (autosp plan), so that the error still names the line."""
    token = _SOURCES.set(False)
    try:
        yield
    finally:
        _SOURCES.reset(token)
_AUTOSP_DIR = os.path.dirname(os.path.abspath(__file__))


def trace(fn, *args) -> Graph:
    """Trace `fn(*args)` into an ir.Graph with global shapes; costs no tensor memory."""
    leaves, in_spec = pytree.tree_flatten(tuple(args))
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(tuple(args))[0]]
    names = _input_names(fn, paths)
    static, tensor_pos = [], []
    for i, (leaf, path) in enumerate(zip(leaves, paths)):
        if isinstance(leaf, torch.Tensor):
            tensor_pos.append(i)
        elif isinstance(leaf, _STATIC_TYPES):
            static.append((i, leaf))
        else:
            raise TraceError(
                f"autosp.trace: argument {_fn_name(fn)}{path} is a {type(leaf).__name__}; arguments must be "
                "pytrees (dict, list, tuple) of tensors and Python scalars. "
                "Fix: pass tensors, or close over this value in the function instead of passing it.")

    out_spec_box = []

    def flat_fn(*tensors):
        full = list(leaves)
        for i, t in zip(tensor_pos, tensors):
            full[i] = t
        out = fn(*pytree.tree_unflatten(full, in_spec))
        flat_out, spec = pytree.tree_flatten(out)
        out_spec_box.append(spec)
        # objects that are neither tensors nor scalars (an HF KV cache) are not results: None
        return [x if isinstance(x, (torch.Tensor,) + _STATIC_TYPES) else None for x in flat_out]

    real = [leaves[i] for i in tensor_pos]
    gm = _make_fx(fn, flat_fn, real, pre_dispatch=True)
    explicit_autocast(gm, ambient=bool(autocast_state()))
    if _leaked_constants(gm):
        # make_fx(pre_dispatch=True) over torch.func transforms leaks the backward's saved
        # tensors as constants; the post-dispatch trace keeps them in the graph (linear -> mm).
        out_spec_box.clear()
        gm = _make_fx(fn, flat_fn, real, pre_dispatch=False)

    inputs = []
    for pos, t in zip(tensor_pos, real):
        role = (Role.PARAM if t.requires_grad else
                Role.FROZEN if isinstance(t, torch.nn.Parameter) and t.is_floating_point() else Role.INPUT)
        inputs.append(Var(names[pos], t.dtype, tuple(t.shape), str(t.device), role=role))
    return lift(gm, inputs, in_spec, out_spec_box[-1], tuple(static))


def _anchor_user_frames(fn) -> None:
    """fx keeps only `forward` frames in stack traces; the user's loss function counts too."""
    register = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)
    while register is not None and fn is not None:
        register(fn)
        fn = getattr(fn, "__wrapped__", None)


def _make_fx(fn, flat_fn, real, *, pre_dispatch: bool) -> torch.fx.GraphModule:
    _anchor_user_frames(fn)
    try:
        with uncompiled():
            return make_fx(flat_fn, decomposition_table=trace_decompositions(), tracing_mode="fake",
                           _allow_non_fake_inputs=True, pre_dispatch=pre_dispatch,
                           **(_STACK_TRACES if _SOURCES.get() else {}))(*real)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes one clear error
        raise _trace_failure(fn, exc) from None


# ---------------------------------------------------------------- autocast, made explicit

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps")


def autocast_state() -> tuple:
    """The autocast regions the caller is in: ((device type, dtype), ...); () outside any. A program traced inside
    one is another program (autosp keys its cache by this)."""
    out = []
    for dev in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(dev):
                out.append((dev, torch.get_autocast_dtype(dev)))
        except (RuntimeError, TypeError):   # a device type this build's autocast does not know
            continue
    return tuple(out)


@contextlib.contextmanager
def no_autocast():
    """Run a traced program as it was traced: its casts are explicit (explicit_autocast), and autocast applied
    again at run time would cast what the user's code kept in fp32 (a region with enabled=False)."""
    with torch._C._DisableAutocast():
        yield


def explicit_autocast(gm: torch.fx.GraphModule, ambient: bool = False) -> None:
    """The autocast regions of a pre-dispatch trace, as the casts autocast made (in place).

    make_fx(pre_dispatch=True) records `with torch.autocast(...)` as _enter_autocast / _exit_autocast and each op
    inside with its inputs' own dtypes (`linear` of fp32 tensors), while the values it recorded are what autocast
    made below the tracer (a bf16 result). A program that ran those ops as recorded would compute in fp32 and differ
    from its own metadata, and autosp's backward, made from the forward program, would not see the casts. Each op
    inside a region (`ambient`: the trace ran inside one, so the whole program) is run again on its fake inputs in
    the same autocast state, and the casts autocast makes of those inputs are written before the op, as `to` the
    dtype it gave each. The region markers go. Nothing here names autocast's op lists: torch decides, per device,
    op and nesting (a region with enabled=False inside another, as RoPE's fp32 frequencies are computed)."""
    stack, markers, changed = [], [], False
    for node in list(gm.graph.nodes):
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name in ("_enter_autocast", "_exit_autocast") and "autocast" in getattr(node.target, "__module__", ""):
            if name == "_enter_autocast":
                stack.append(node.args)
            else:
                stack.pop()
            markers.append(node)
            continue
        if (ambient or stack) and node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            changed |= _cast_inputs(gm, node, stack)
    for node in reversed(markers):
        gm.graph.erase_node(node)
    if markers or changed:
        gm.recompile()


def _autocast_contexts(regions) -> contextlib.ExitStack:
    """The autocast state the trace ran an op in (the caller's, then the regions', innermost last), each without
    autocast's cast cache, so that every cast is made again where it can be seen."""
    stack = contextlib.ExitStack()
    for dev, dtype in autocast_state():
        stack.enter_context(torch.autocast(dev, dtype=dtype, cache_enabled=False))
    for dev, dtype, enabled in map(_region, regions):
        stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=False))
    return stack


def _region(args) -> tuple:
    """(device type, dtype, enabled) of an _enter_autocast's arguments (torch.autocast's, in its order)."""
    dev, dtype, enabled = (list(args) + [None, None, True])[:3]
    return dev, dtype, bool(enabled)


def _enabled(regions) -> list[str]:
    """The device types autocast is on for, in the caller's state and then the regions', innermost last."""
    on = {dev: True for dev, _ in autocast_state()}
    for dev, _, enabled in map(_region, regions):
        on[dev] = enabled
    return [dev for dev, enabled in on.items() if enabled and dev != "meta"]


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """The casts an op's autocast kernel makes of the op's own inputs: {id(input): dtype}."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs, self.casts = {id(t): t for t in inputs}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and args and id(args[0]) in self.inputs:
            dtype = kwargs.get("dtype", args[1] if len(args) > 1 else None)
            if isinstance(dtype, torch.dtype) and dtype != args[0].dtype:
                self.casts.setdefault(id(args[0]), dtype)
        return func(*args, **kwargs)


def _cast_inputs(gm: torch.fx.GraphModule, node: torch.fx.Node, regions) -> bool:
    """Write the casts autocast makes of `node`'s inputs before it; whether there were any."""
    vals = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a     # noqa: E731
    args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), vals)
    leaves = pytree.tree_leaves((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not tensors or any(isinstance(x, torch.fx.Node) for x in leaves):
        return False                               # no floating input, or one without a recorded value
    if any(t.device.type == "meta" for t in tensors) and _enabled(regions):
        raise TraceError(
            f"autosp.trace: `{node.target}` at {user_frame(node.meta.get('stack_trace')) or '<unknown>'} runs inside "
            f"torch.autocast ({', '.join(_enabled(regions))}) on meta tensors, which autocast does not cast: the "
            "program, and a plan made from it, would compute in fp32. Fix: trace with tensors of the device autocast "
            "names (fake ones: FakeTensorMode), or hold the weights in the compute dtype instead of autocasting "
            "(`autosp plan --precision bf16`).")
    seen = _Casts(tensors)
    try:
        with _autocast_contexts(regions), seen:
            node.target(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the op ran in the trace: a failure here is autosp's to explain
        raise TraceError(f"autosp.trace: `{node.target}` at {user_frame(node.meta.get('stack_trace')) or '<unknown>'}"
                         f" inside torch.autocast could not be run again to see autocast's casts ({exc}). Fix: "
                         "run that op in an autocast(enabled=False) block, its inputs cast by hand.") from None
    if not seen.casts:
        return False

    def cast(a):
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        dtype = seen.casts.get(id(v)) if isinstance(v, torch.Tensor) else None
        if dtype is None:
            return a
        with gm.graph.inserting_before(node):
            c = gm.graph.call_function(torch.ops.aten.to.dtype, (a, dtype))
        c.meta.update(stack_trace=node.meta.get("stack_trace"), val=v.to(dtype))
        return c

    node.args, node.kwargs = torch.fx.node.map_arg((node.args, node.kwargs), cast)
    return True


def _leaked_constants(gm: torch.fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            t = _get_attr(gm, node.target)
            if isinstance(t, FakeTensor) or torch._C._functorch.is_functorch_wrapped_tensor(t):
                return True
    return False


def lift(gm: torch.fx.GraphModule, inputs, in_spec=None, out_spec=None, static=()) -> Graph:
    """An fx graph from make_fx -> ir.Graph. Inputs are given (names, roles) in placeholder order."""
    env: dict[torch.fx.Node, object] = {}
    eqns, consts, outputs = [], [], ()
    placeholders = iter(inputs)
    counter = iter(range(1 << 62))

    def new_var(val) -> Var:
        if isinstance(val, torch.Tensor):
            return Var(str(next(counter)), val.dtype, tuple(int(d) for d in val.shape), str(val.device))
        return Var(str(next(counter)), None, ())

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "get_attr":
            t = _get_attr(gm, node.target)
            v = Var(f"c{len(consts)}", t.dtype, tuple(t.shape), str(t.device), role=Role.CONST)
            consts.append((v, t))
            env[node] = v
        elif node.op == "call_function":
            if node.target in _DATA_DEPENDENT:
                where = user_frame(node.meta.get("stack_trace")) or "<unknown>"
                raise TraceError(
                    f"autosp.trace: `.item()` (aten.{node.target.__name__}) at {where} turns a tensor "
                    "into a Python number, so the graph would depend on data it cannot see. "
                    "Fix: keep the value a tensor (e.g. `x * t.max()` instead of `x * t.max().item()`), "
                    "or pass the number as a Python argument.")
            if node.target is operator.getitem and isinstance(env.get(node.args[0]), tuple):
                env[node] = env[node.args[0]][node.args[1]]
                continue
            args = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
            val = node.meta.get("val")
            _refuse_data_dependent_shape(node, val)
            multi = isinstance(val, (tuple, list))
            outs = tuple(new_var(x) for x in val) if multi else (() if val is None else (new_var(val),))
            eqns.append(Eqn.make(op_for(node.target), args, kwargs, outs, multi=multi,
                                 source=user_frame(node.meta.get("stack_trace"))))
            env[node] = outs if multi else (outs[0] if outs else None)
        elif node.op == "output":
            outputs = tuple(torch.fx.node.map_arg(node.args[0], env.__getitem__))
        else:
            raise TraceError(f"autosp.trace: unexpected fx node {node.format_node()}")
    return Graph(tuple(inputs), tuple(eqns), outputs, in_spec, out_spec, tuple(consts), tuple(static))


def _refuse_data_dependent_shape(node: torch.fx.Node, val) -> None:
    """TraceError where an op's result has a size that its input values decide (nonzero, masked_select, boolean
    indexing, unique): the trace holds it as an unbacked symbol, and no program of fixed shapes can run it."""
    for x in val if isinstance(val, (tuple, list)) else (val,):
        if isinstance(x, torch.Tensor) and not all(isinstance(d, int) for d in x.shape):
            where = user_frame(node.meta.get("stack_trace")) or "<unknown>"
            name = getattr(node.target, "__name__", str(node.target))
            raise TraceError(
                f"autosp.trace: aten.{name} at {where} makes a tensor of shape {[str(d) for d in x.shape]}, whose size "
                "depends on the values of its input, so the program cannot be planned or sharded before it runs. "
                "Fix: keep shapes fixed (torch.where(mask, x, 0) or a masked sum instead of nonzero, masked_select "
                "or boolean indexing), or compute the indices outside the traced function and pass them in.")


def user_frame(stack_trace: str | None) -> str | None:
    """The innermost frame of the user's code ('file:line in fn: code'), skipping torch and autosp."""
    if not stack_trace:
        return None
    lines = stack_trace.strip().splitlines()
    best = None
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("File "):
            path = s.split('"')[1] if '"' in s else ""
            if path.startswith(_TORCH_DIR) or path.startswith(_AUTOSP_DIR):
                continue
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            lineno = s.split("line ")[1].split(",")[0] if "line " in s else "?"
            func = s.split(" in ")[-1] if " in " in s else "?"
            best = f"{os.path.basename(path)}:{lineno} in {func}: {code}"
    return best


def _trace_failure(fn, exc: Exception) -> TraceError:
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not f.filename.startswith(_TORCH_DIR) and not f.filename.startswith(_AUTOSP_DIR)]
    where = f"{os.path.basename(user[-1].filename)}:{user[-1].lineno}: {user[-1].line}" if user else "<unknown>"
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    low = text.lower()
    if "data-dependent" in low or "data dependent" in low or "item()" in low or "guard" in low \
            or "dynamicoutputshape" in low or "datadependent" in low:
        fix = ("the value of a tensor decides Python control flow or a shape here (`.item()`, `if t:`, "
               "`bool(t)`, nonzero/masked_select). Fix: compute with torch.where / masks instead of "
               "branching, or pass the value as a Python int argument")
    elif "grouped_mm" in where or any("grouped_mm" in (f.line or "") for f in frames):
        fix = ("torch's grouped_mm has no fake kernel for these dtypes in this form. autosp rewrites the "
               "(M, K) x (G, K, N) form with offsets (transformers' MoE experts) and (G, M, K) x (G, K, N) "
               "while tracing; the others trace in bf16 only. Fix: call grouped_mm in one of those forms, "
               "or build the model with experts_implementation=\"batched_mm\"")
    else:
        fix = ("Fix: the function raised this on arguments of these shapes and dtypes; check them against "
               "what it expects (it must run on one device as written)")
    return TraceError(f"autosp.trace: could not trace {_fn_name(fn)} at {where}\n  {text}\n  {fix}.")


def _fn_name(fn) -> str:
    return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))


def _input_names(fn, paths: list[str]) -> list[str]:
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names, seen = [], set()
    for path in paths:
        # path looks like "[0]['model.embed.weight']" or "[1]"
        parts = [p.strip("'\"") for p in path.strip("[]").split("][")]
        head = int(parts[0]) if parts[0].isdigit() else 0
        base = params[head] if head < len(params) else f"arg{head}"
        name = ".".join([base] + parts[1:])
        while name in seen:
            name += "_"
        seen.add(name)
        names.append(name)
    return names


def _get_attr(gm, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
