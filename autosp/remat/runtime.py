"""Run a remat Program: an autograd.Function whose saved tensors are exactly the plan's.

forward:  the forward program on the primals -> outputs (returned), saved values and host
          copies (kept for the backward);
backward: tangents scaled by the step's output factors (grad_scale), the backward program
          on (primals, saved, host copies, tangents), then each parameter's gradient summed
          over its groups (grad_sync), in place: the program's outputs are fresh tensors.

The backward program uses the boxed calling convention (it takes one list and empties it),
and the Function releases its saved tensors before calling it, so every saved value is
freed right after its last backward use, as the memory model assumes.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.fx as fx

from autosp.collectives import _pg
from autosp.ir.lower import lower
from autosp.passes.autodiff import Joint, StepBoundary
from autosp.remat import template
from autosp.remat.apply import Program
from autosp.trace import no_autocast


class _BoxedCodeGen(fx.graph.CodeGen):
    """`def forward(self, args)`: unpack the list, then clear it, so the caller keeps no references."""

    def gen_fn_def(self, free_vars, maybe_return_annotation, **kwargs):
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        head = f"def {getattr(self, '_func_name', 'forward')}(self, args){maybe_return_annotation}:"
        if not names:
            return head
        return head + f"\n    ({', '.join(names)},) = args\n    args.clear()"


def lower_boxed(graph) -> fx.GraphModule:
    gm = lower(graph)
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm


def memory_cuts(timeline, limit: int, eqns=None) -> list[int]:
    """Where to cut a program compiled by inductor (autosp.ir.inductor) so that it stays under `limit` bytes however
    inductor fuses and orders the equations of a segment: at worst a segment makes all its values first and frees
    what it frees last, so a segment ends before the equation that would take that worst case above the limit.
    `timeline`: the program's (autosp.remat.liveness.Timeline). Where memory is far below the limit a segment is
    long; near the peak, cuts come often (a recomputation fused with an earlier layer's kernel would run earlier
    than planned, and two kernels fused hold the inputs the first would have freed).

    With the program's `eqns`, repeated layers (template.repeats) are cut alike, so that inductor compiles a layer's
    segments once and the other layers reuse them (ir.inductor): memory grows layer by layer in a forward and falls
    in a backward, so otherwise each layer's cuts fall elsewhere and each layer is different code. Each layer then
    starts a segment and is cut as the worst of them would be, equation by equation (the most live before it, the
    most it makes), which keeps every one under the limit; layers that need no cut of their own are left to the
    plain rule. More cuts than each layer needs alone (8 layers of the tests' Llama at s = 1024: 155 segments in the
    backward instead of 130 at the least budget, 53 instead of 17 at 1.0), for a step measured no slower (within
    0.5 %) and a first call in well under half the time (bench/compile_layers.py: 36 s instead of 97)."""
    live = [timeline.start, *timeline.after[:-1]]                   # bytes before each equation
    made = [max(0, d - b) for d, b in zip(timeline.during, live)]
    starts: set[int] = set()
    for start, period, count, rest in (template.repeats(eqns) if eqns is not None else ()):
        # the equations alike, one per layer (the rest: a last layer's first equations)
        alike = [range(p, p + (count + (p - start < rest)) * period, period) for p in range(start, start + period)]
        worst_live = [max(live[k] for k in ks) for ks in alike]
        worst_made = [max(made[k] for k in ks) for ks in alike]
        if not _cut(worst_live, worst_made, limit, set()):
            continue
        for ks, most_live, most_made in zip(alike, worst_live, worst_made):
            for k in ks:
                live[k], made[k] = most_live, most_made
        starts.update(range(start, start + (count + 1) * period, period))
    return _cut(live, made, limit, starts)


def _cut(live: list[int], made: list[int], limit: int, starts: set[int]) -> list[int]:
    """memory_cuts' rule: `live` bytes before each equation, `made` while it runs; a cut at each of `starts` too."""
    cuts, worst = [], live[0] if live else 0      # worst: the segment's worst case so far
    for k in range(len(live)):
        if k and (k in starts or worst + made[k] > limit):
            cuts.append(k)
            worst = live[k]
        worst += made[k]
    return cuts


def offload_cuts(graph) -> list[int]:
    """A cut after every offload of a compiled program: the value it copies out must go back to the allocator,
    not to inductor. On a GPU the copy to the host runs on a side stream after the offload returns, and the value's
    memory may be used again only once it is done: the caching allocator knows (the op records the side stream on
    the value), but inductor reuses a dead buffer of its own for a later kernel's output directly, which would
    overwrite the value while it is still being copied. Ending the segment at the offload leaves no later kernel
    in it, and the segment's end hands its dead buffers to the allocator. Offloads one after another share a cut
    (the later ones make host tensors only)."""
    eqns = graph.eqns
    return [k + 1 for k, e in enumerate(eqns) if e.op.name == "offload" and k + 1 < len(eqns)
            and eqns[k + 1].op.name != "offload"]


class Runner:
    """The compiled step: lowered forward and (boxed) backward, with the boundary's bookkeeping."""

    def __init__(self, program: Program, joint: Joint, boundary: StepBoundary, compiled: bool = False,
                 device: str = "cpu"):
        from autosp.passes.schedule import schedule_program
        program = schedule_program(program)     # collectives started early, waited late (passes/schedule.py)
        self.program = program
        self.compiled = compiled
        if compiled:                  # inductor, at the first call of each (autosp.ir.inductor): boxed, both
            from autosp.ir.inductor import Compiled
            from autosp.remat.plan import simulate_step
            mem = simulate_step(program, device)
            self.forward = Compiled(program.forward, cuts=memory_cuts(mem.forward, mem.peak, program.forward.eqns)
                                    + offload_cuts(program.forward))
            self.backward = Compiled(program.backward, cuts=memory_cuts(mem.backward, mem.peak,
                                                                      program.backward.eqns))
        else:
            self.forward = lower(program.forward)
            self.backward = lower_boxed(program.backward)
        self.n_out = program.n_outputs
        self.n_primals = joint.n_primals
        self.diff_inputs = joint.diff_inputs
        self.diff_outputs = joint.diff_outputs
        self.scale = boundary.scale
        self.sync = dict(boundary.sync)
        # an in-place all-reduce must not write a storage the program shares (compiled code may also return one
        # buffer for two outputs: _RematStep.backward looks at their storages then)
        self.copy_grad = _shared_outputs(program.backward)

    def groups(self, i: int) -> tuple[str, ...]:
        """The groups input i's gradient is summed over, less those of one rank (a sum over one rank changes
        nothing, and its in-place all-reduce would want contiguous memory)."""
        if not hasattr(self, "_groups"):
            self._groups = {j: tuple(g for g in gs if dist.get_world_size(_pg(g)) > 1) for j, gs in self.sync.items()}
        return self._groups.get(i, ())

    def run_forward(self, primals) -> list:
        return self.forward(list(primals)) if self.compiled else self.forward(*primals)

    def __call__(self, *primals):
        if not torch.is_grad_enabled() or not any(
                isinstance(primals[i], torch.Tensor) and primals[i].requires_grad for i in self.diff_inputs):
            with torch.no_grad():
                return tuple(self.run_forward(primals)[:self.n_out])
        return _RematStep.apply(self, *primals)


class _RematStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Runner, *primals):
        res = run.run_forward(primals)
        outs, kept = res[:run.n_out], res[run.n_out:]
        ctx.run = run
        ctx.save_for_backward(*primals, *kept)
        diff = set(run.diff_outputs)
        ctx.mark_non_differentiable(*[o for j, o in enumerate(outs)
                                      if isinstance(o, torch.Tensor) and j not in diff])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gouts):
        run: Runner = ctx.run
        args = list(ctx.saved_tensors)
        clear = getattr(ctx, "maybe_clear_saved_tensors", None)
        if clear is not None:
            clear()           # the list holds the only references now: freed as the backward consumes them
        for j in run.diff_outputs:
            g = gouts[j]
            if g is None:
                o = run.program.forward.outputs[j]
                g = torch.zeros(o.shape, dtype=o.dtype, device=o.device)
            elif run.scale[j] != 1.0:
                g = g * run.scale[j]
            args.append(g)
        del gouts
        primal_keys = {_key(t) for t in args[:run.n_primals] if isinstance(t, torch.Tensor)} if run.compiled else ()
        with no_autocast():           # a backward() called inside an autocast region: the program's casts are its own
            grads = run.backward(args)
        copy_grad = run.copy_grad
        if run.compiled:              # what inductor's code returned: a primal's storage, or one shared by two outputs
            keys = [_key(g) if isinstance(g, torch.Tensor) else None for g in grads]
            twice = {k for k, n in Counter(keys).items() if n > 1}
            copy_grad = [c or (k is not None and (k in primal_keys or k in twice)) for c, k in zip(copy_grad, keys)]
        out = [None] * run.n_primals
        posted = []
        for i, g, copy in zip(run.diff_inputs, grads, copy_grad):
            groups = run.groups(i)
            if groups:                # every sum posted before the first is waited: they overlap one another
                # all_reduce works in place on contiguous memory: a matmul's gradient is a transposed view of its
                # own dense block, summed as that block; a clone (memory the plan does not hold) only where the
                # storage is shared or not one block
                dense = None if copy else _dense_view(g)
                if dense is None:
                    g = dense = g.clone(memory_format=torch.contiguous_format)
                posted.append((dense, list(groups)))
            out[i] = g
        grads = g = dense = None
        _all_reduce_posted(posted)
        posted = None
        for i, g in enumerate(out):   # each in its parameter's layout: a fused optimizer reads the memory as it is
            if isinstance(g, torch.Tensor) and not g.is_contiguous():
                out[i] = None         # one at a time, its first form let go as its copy is made
                out[i] = g.contiguous()
            del g
        return (None, *out)


def _dense_view(g: torch.Tensor) -> torch.Tensor | None:
    """g, or its dimensions reordered so that the view is contiguous (the same memory, e.g. the transpose of a
    matmul's output); None if no order is (a slice, a broadcast)."""
    if g.is_contiguous():
        return g
    v = g.permute(sorted(range(g.dim()), key=lambda d: -g.stride(d)))
    return v if v.is_contiguous() else None


def _all_reduce_posted(posted: list) -> None:
    """Sum each gradient over its groups in place: every gradient's first all-reduce posted, then each waited and
    its next group's posted (a dp x sp mesh sums over sp, then dp). On gloo the backend gets aliases, emptied once
    waited (collectives._handed's reason)."""
    from autosp.inflight import _handles
    while posted:
        works = []
        for g, groups in posted:
            pg = _pg(groups.pop(0))
            (h,) = _handles(pg, g)
            works.append((dist.all_reduce(h, group=pg, async_op=True), h, g))
        for w, h, g in works:
            w.wait()
            if h is not g:
                h.set_()
        posted = [(g, groups) for g, groups in posted if groups]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _shared_outputs(graph) -> list[bool]:
    """Per output: True if its storage is not its own (an input's, or shared with another output), so an in-place
    all-reduce on it would change something else. A view of a storage the program made for it alone (a matmul's
    gradient transposed) is its own: once the program returns nothing else lives in it."""
    from autosp.ir.aliases import roots
    root = roots(graph)
    inputs = {v.name for v in graph.inputs}
    seen: dict[str, int] = {}
    for o in graph.outputs:
        seen[root[o.name]] = seen.get(root[o.name], 0) + 1
    return [root[o.name] in inputs or seen[root[o.name]] > 1 for o in graph.outputs]
