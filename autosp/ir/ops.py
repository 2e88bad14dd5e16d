"""The canonical op vocabulary: every equation's op is an `Op` (name, callable, tags).

Aten overloads that mean the same thing to a pass share one canonical name
(all SDPA overloads are `attention`); everything else keeps its aten name, so
nothing is lost and the interpreter can always call `op.target`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

import torch

aten = torch.ops.aten


class Tag(enum.Enum):
    ATTENTION = "attention"
    LINEAR = "linear"
    MATMUL = "matmul"
    EMBEDDING = "embedding"
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    VIEW = "view"
    INDEX = "index"            # indexes along a dim: arange, slice, pad, cat, roll, cumsum, ...
    LOSS = "loss"
    RANDOM = "random"
    CREATION = "creation"      # new tensors from sizes: zeros, ones, full, empty
    COLLECTIVE = "collective"
    INPLACE = "inplace"
    NORM = "norm"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class Op:
    name: str
    target: Callable[..., Any] = None  # the callable the interpreter and lowering call
    tags: frozenset = frozenset()

    def has(self, tag: Tag) -> bool:
        return tag in self.tags

    def __str__(self) -> str:
        return self.name


def _ov(packet_name: str, *overloads: str):
    packet = getattr(aten, packet_name, None)
    if packet is None:
        return []
    return [getattr(packet, o) for o in overloads if hasattr(packet, o)]


# canonical name -> (tags, aten overloads)
_VOCAB: dict[str, tuple[frozenset, list]] = {}


def _add(name: str, tags, overloads):
    _VOCAB[name] = (frozenset(tags), [o for o in overloads])


_add("attention", {Tag.ATTENTION},
     _ov("scaled_dot_product_attention", "default")
     + _ov("_scaled_dot_product_flash_attention_for_cpu", "default")
     + _ov("_scaled_dot_product_flash_attention", "default")
     + _ov("_scaled_dot_product_efficient_attention", "default")
     + _ov("_scaled_dot_product_cudnn_attention", "default")
     + _ov("_scaled_dot_product_attention_math", "default"))
_add("linear", {Tag.LINEAR}, _ov("linear", "default"))
_add("matmul", {Tag.MATMUL}, _ov("matmul", "default") + _ov("mm", "default") + _ov("bmm", "default"))
_add("addmm", {Tag.MATMUL}, _ov("addmm", "default") + _ov("baddbmm", "default"))
_add("einsum", {Tag.MATMUL}, _ov("einsum", "default"))
_add("embedding", {Tag.EMBEDDING}, _ov("embedding", "default"))
_add("stack", {Tag.INDEX}, _ov("stack", "default"))
_add("view_as_complex", {Tag.VIEW}, _ov("view_as_complex", "default"))
_add("view_as_real", {Tag.VIEW}, _ov("view_as_real", "default"))
_add("topk", {Tag.OTHER}, _ov("topk", "default"))
_add("sort", {Tag.OTHER}, _ov("sort", "default", "stable"))
_add("argsort", {Tag.OTHER}, _ov("argsort", "default", "stable"))
_add("kthvalue", {Tag.OTHER}, _ov("kthvalue", "default"))
_add("slice_scatter", {Tag.INDEX}, _ov("slice_scatter", "default"))
_add("select_scatter", {Tag.INDEX}, _ov("select_scatter", "default"))
_add("scatter", {Tag.INDEX}, _ov("scatter", "src", "value", "reduce", "value_reduce"))
_add("scatter_add", {Tag.INDEX}, _ov("scatter_add", "default"))
_add("index_add", {Tag.INDEX}, _ov("index_add", "default"))
_add("index_put", {Tag.INDEX}, _ov("index_put", "default"))
_add("copy", {Tag.ELEMENTWISE}, _ov("copy", "default"))         # copy(dst, src): src broadcast into dst's shape
_add("histc", {Tag.REDUCTION}, _ov("histc", "default"))
for _c in ("new_empty", "new_zeros", "new_ones", "new_full"):
    _add(_c, {Tag.CREATION}, _ov(_c, "default"))
_add("cross_entropy", {Tag.LOSS}, _ov("cross_entropy_loss", "default"))
_add("nll_loss", {Tag.LOSS}, _ov("nll_loss", "default") + _ov("nll_loss_nd", "default")
     + _ov("nll_loss_forward", "default") + _ov("nll_loss2d_forward", "default"))
_add("arange", {Tag.INDEX, Tag.CREATION}, _ov("arange", "default", "start", "start_step"))
_add("slice", {Tag.INDEX, Tag.VIEW}, _ov("slice", "Tensor"))
_add("narrow", {Tag.INDEX, Tag.VIEW}, _ov("narrow", "default"))
_add("select", {Tag.INDEX, Tag.VIEW}, _ov("select", "int"))
_add("pad", {Tag.INDEX}, _ov("pad", "default") + _ov("constant_pad_nd", "default"))
_add("cat", {Tag.INDEX}, _ov("cat", "default"))
_add("roll", {Tag.INDEX}, _ov("roll", "default"))
_add("cumsum", {Tag.INDEX}, _ov("cumsum", "default"))
_add("flip", {Tag.INDEX}, _ov("flip", "default"))
_add("tril", {Tag.INDEX}, _ov("tril", "default"))
_add("triu", {Tag.INDEX}, _ov("triu", "default"))
_add("index_select", {Tag.INDEX}, _ov("index_select", "default"))
_add("gather", {Tag.INDEX}, _ov("gather", "default"))
_add("index", {Tag.INDEX}, _ov("index", "Tensor"))
for _v in ("view", "reshape", "_unsafe_view", "expand", "permute", "transpose", "t", "unsqueeze",
           "squeeze", "flatten", "unflatten", "contiguous", "alias", "clone", "detach", "unbind",
           "split", "split_with_sizes", "chunk", "repeat_interleave", "repeat", "expand_as",
           "view_as", "reshape_as", "movedim"):
    _add(_v, {Tag.VIEW}, _ov(_v, "default", "int", "dim", "dims", "Tensor", "self_int", "using_ints",
                             "int_list"))
for _c in ("zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like",
           "scalar_tensor", "lift_fresh_copy"):
    _add(_c, {Tag.CREATION}, _ov(_c, "default"))
for _r in ("rand", "randn", "randint", "rand_like", "randn_like", "bernoulli", "native_dropout",
           "dropout", "normal", "uniform"):
    _add(_r, {Tag.RANDOM}, _ov(_r, "default", "p", "low", "Tensor", "functional"))
for _red in ("sum", "mean", "amax", "amin", "max", "min", "prod", "logsumexp", "any", "all",
             "argmax", "argmin", "var", "std", "norm"):
    _add(_red, {Tag.REDUCTION}, _ov(_red, "default", "dim_IntList", "dim", "dim_Scalar", "correction",
                                   "ScalarOpt_dim", "names_dim"))
for _n in ("softmax", "_softmax", "log_softmax", "_log_softmax", "layer_norm", "native_layer_norm",
           "rms_norm", "group_norm"):
    _add(_n, {Tag.NORM}, _ov(_n, "default", "int"))

# Pointwise ops (unary, binary, ternary): aten marks them with the `pointwise` tag.
_BY_TARGET: dict[Any, Op] = {}
for _name, (_tags, _ovs) in _VOCAB.items():
    for _o in _ovs:
        _BY_TARGET[_o] = Op(_name, _o, _tags)


_COLLECTIVES = {"all_to_all", "all_reduce_sum", "all_gather_seq", "shard_slice", "unshard_grad",
                "all_gather_param", "reduce_scatter_param", "zigzag_exchange", "halo_exchange", "halo_grad",
                "all_to_all_start", "all_gather_param_start", "reduce_scatter_param_start"}


def op_for(target) -> Op:
    """The canonical Op for an fx call_function target."""
    target = getattr(target, "_opoverload", target)      # a torch.library CustomOpDef
    op = _BY_TARGET.get(target)
    if op is not None:
        return op
    if isinstance(target, torch._ops.OpOverload):
        tags = set()
        if torch.Tag.pointwise in target.tags:
            tags.add(Tag.ELEMENTWISE)
        if any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments):
            tags.add(Tag.INPLACE)
        short = str(target).removeprefix("aten.")
        if target.namespace == "autosp":
            short = target._schema.name.split("::")[-1]
            if short in _COLLECTIVES:
                tags.add(Tag.COLLECTIVE)
        op = Op(short, target, frozenset(tags or {Tag.OTHER}))
    else:
        op = Op(getattr(target, "__name__", str(target)), target, frozenset({Tag.OTHER}))
    _BY_TARGET[target] = op
    return op
