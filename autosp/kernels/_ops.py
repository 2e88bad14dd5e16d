"""What both kernel families share around their custom ops: the error format and autograd.

`fail(op, what, fix)` is the one shape of their input errors: "autosp.<op>: <what>; <fix>".

`differentiable(op, setup_context, backward)` is the one way an op gets its autograd: one
(setup_context, backward) pair per op, given to torch both ways it is needed, because on
torch 2.13 each way alone misses a case (checked by tests/test_kernels.py):

  - `op.register_autograd` makes the op itself differentiable. Graphs that call the op need
    it: autosp.trace records `autosp::flash_attention` (or a Ulysses op) from the user's
    code, and autosp.passes.autodiff runs that graph under autograd. But torch.func (grad,
    vjp) refuses it: the autograd.Function torch generates for it has no `setup_context`.
  - an autograd.Function with `setup_context`, whose forward calls the op, is what torch.func
    takes, and make_fx still records the op inside it; the public wrappers call it. Alone it
    would leave the op in a traced graph without a derivative.

Backward functions that call another op call its differentiable form (or run under
no_grad), never the raw op with grad-tracking inputs: under torch.func that would reach the
generated Function again.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from autosp.errors import AutospError


def fail(op: str, what: str, fix: str):
    raise AutospError(f"autosp.{op}: {what}; {fix}")


def differentiable(op, setup_context, backward):
    """Register (setup_context, backward) as `op`'s autograd and return `op` as a callable that
    torch.func can differentiate too (see the module docstring).

    The pair has register_autograd's signatures: setup_context(ctx, inputs, output) with the op's
    own arguments and output; backward(ctx, *grads) -> one gradient per argument (a list for a
    list argument), grads as one list for an op that returns a list."""
    op.register_autograd(backward, setup_context=setup_context)
    returns = op._opoverload._schema.returns
    list_out = len(returns) == 1 and isinstance(returns[0].type, torch.ListType)

    class Function(torch.autograd.Function):
        # Tensor lists are spliced into the arguments (autograd tracks only top-level tensors).
        @staticmethod
        def forward(spec, *flat):
            out = op(*pytree.tree_unflatten(list(flat), spec))
            return tuple(out) if list_out else out

        @staticmethod
        def setup_context(ctx, inputs, output):
            spec, *flat = inputs
            args = pytree.tree_unflatten(flat, spec)
            ctx.autosp_leaves = [len(pytree.tree_leaves(a)) for a in args]
            setup_context(ctx, args, list(output) if list_out else output)

        @staticmethod
        def backward(ctx, *grads):
            per_arg = backward(ctx, list(grads)) if list_out else backward(ctx, *grads)
            flat = []
            for g, n in zip(per_arg, ctx.autosp_leaves):
                flat += list(g) if isinstance(g, (list, tuple)) else [g] * n if g is None else [g]
            return None, *flat

    Function.__name__ = Function.__qualname__ = f"{op._name}_function"

    def call(*args):
        flat, spec = pytree.tree_flatten(args)
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
            out = Function.apply(spec, *flat)
            return list(out) if list_out else out
        return op(*args)  # no gradient can flow: skip Function.apply's ~50 us of Python

    call.__name__ = call.__qualname__ = op._name
    return call
