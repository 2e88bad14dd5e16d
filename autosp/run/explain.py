"""`autosp explain`: what autosp makes of a model at one length, and its memory over one step.

The summary says how many equations the sharded program has, which values are sharded along the
sequence, which collectives run (with their shapes and bytes), and the remat plan under the budget.
The PNG plots the per-rank bytes live at every equation of one training step (the liveness model
of autosp.remat), without remat and with the plan. `--full` prints every program instead.
"""
from __future__ import annotations

from collections import Counter

import torch

from autosp.errors import AutospError
from autosp.run.meshes import fake_world
from autosp.run.models import describe, spec_of
from autosp.run.plan import _step, fmt

_COLLECTIVES = {"all_to_all", "all_reduce_sum", "all_gather_seq", "shard_slice", "unshard_grad", "halo_exchange",
                "halo_grad"}


def _short(name: str) -> str:
    return name.split(".")[0]


def _layouts(graph) -> Counter:
    kinds = Counter()
    for e in graph.eqns:
        for v in e.outputs:
            if v.dtype is None:
                continue
            if v.layout is None:
                kinds["no sequence dim, or whole sequence on h/P heads"] += 1
            elif v.layout.sharded:
                kinds["sequence-sharded (sp s)"] += 1
            else:
                kinds["sequence dim, replicated"] += 1
    return kinds


def _collectives(graph) -> list[str]:
    rows = Counter()
    size = {}
    for e in graph.eqns:
        name = _short(e.op.name)
        if name not in _COLLECTIVES:
            continue
        key = (name, " ".join(v.type_str() for v in e.inputs if v.dtype is not None))
        rows[key] += 1
        size[key] = sum(v.nbytes() for v in e.inputs)
    return [f"  {name} x{count}: {types} ({fmt(size[(name, types)])} in each)"
            for (name, types), count in sorted(rows.items())]


def _timeline(program, device: str) -> tuple[list[int], int]:
    """Bytes live while each equation of the step runs on `device`, and where the backward starts."""
    from autosp.remat import simulate_step
    mem = simulate_step(program, device)
    return list(mem.forward.during) + list(mem.backward.during), len(mem.forward.during)


def plot_timelines(png: str, curves: list[tuple[str, list[int], int]], budget: int | None, title: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for label, values, split in curves:
        xs = [i / max(1, len(values) - 1) for i in range(len(values))]
        line, = ax.plot(xs, [v / 2**20 for v in values], lw=1.1, label=f"{label}: peak {fmt(max(values))}")
        ax.axvline(split / max(1, len(values) - 1), color=line.get_color(), ls=":", lw=0.8)
    if budget is not None:
        ax.axhline(budget / 2**20, color="gray", ls="--", lw=0.8, label=f"budget {fmt(budget)}")
    ax.set_xlabel("position in the step (forward, then backward after the dotted line)")
    ax.set_ylabel("MiB live per rank")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def explain_model(step, *, full: bool = False, png: str | None = None) -> str:
    """`autosp explain` of a Step (run/config.py): its program and the plan `autosp train` would run, under
    --memory-budget, or the budget --memory leaves the step, or half the no-remat peak."""
    import autosp
    from autosp.run.answer import _tracer, model_state
    spec = spec_of(step)
    seq_len, sp, batch, device = step.seq_len, step.sp, step.rank_batch, step.target
    dtype = step.dtype
    with fake_world(step.world):
        tracer = _tracer(step, spec)
        st = model_state(step, tracer.param_bytes, tracer.trainable_bytes)
        budget = step.step_budget(st.resident + step.token_bytes())
        budget = 0.5 if budget is None else budget
        if full:
            text = autosp.explain(tracer.loss_fn, tracer.mesh, *tracer.step_args(seq_len), memory_budget=budget,
                                  ring=step.ring, host_bandwidth=step.host_bandwidth, device=device,
                                  host_memory=step.activation_host_bytes(st.host))
        p = tracer.trace(seq_len)
        none_plan, none_prog = _step(p.local, None, device)
        try:
            from autosp.remat import plan_step
            plan, prog, _, _ = plan_step(p.local, budget, device=device, host_bandwidth=step.host_bandwidth,
                                         host_memory=step.activation_host_bytes(st.host),
                                         tiles=None if step.tile else {})
        except AutospError as exc:
            raise AutospError(f"--memory-budget {budget}: {exc}") from None
    model = step.model
    head = [f"autosp explain: {describe(spec)}",
            f"  sequence {seq_len:,} over sp={sp} ({seq_len / sp:,.0f} per rank), batch {batch}, {dtype}; "
            f"{len(p.graph.eqns)} global equations -> {len(p.local.eqns)} per rank; "
            f"step programs: {len(none_prog.forward.eqns)} forward + {len(none_prog.backward.eqns)} backward "
            "equations without remat"]
    lines = head + ["values per rank (the forward):"]
    lines += [f"  {n:5d}  {kind}" for kind, n in _layouts(p.local).most_common()]
    lines += ["collectives in the forward (the backward runs their transposes):"] + _collectives(p.local)
    from autosp.api import mesh_info
    from autosp.passes.dce import dce
    from autosp.passes.shard import analyse
    with fake_world(step.world):
        live = dce(p.graph)
        lines += [line[2:] for line in analyse(live, mesh_info(tracer.mesh)).summary(live).splitlines()]
    recomputed = [e for e in prog.backward.eqns if _short(e.op.name) == "all_to_all"]
    n_a2a = sum(_short(e.op.name) == "all_to_all" for e in none_prog.backward.eqns)
    lines += [f"all-to-alls in the backward: {n_a2a} without remat, {len(recomputed)} with the plan "
              f"({len(recomputed) - n_a2a} recomputed)", "", str(plan), ""]
    budget_bytes = plan.budget_bytes
    curves = [("no remat", *_timeline(none_prog, device)), (f"plan (budget {budget})", *_timeline(prog, device))]
    from autosp.passes.schedule import overlap_summary
    from autosp.remat.cost import device_for
    lines += overlap_summary(prog, device_for(device, step.host_bandwidth)).splitlines()
    lines.append(f"per-rank peak: {fmt(none_plan.peak_bytes)} without remat, {fmt(plan.peak_bytes)} with the plan "
                 f"({plan.peak_bytes / none_plan.peak_bytes:.2f}x); recompute {plan.recompute_flops:.3g} FLOPs")
    if png:
        got = plot_timelines(png, curves, budget_bytes, f"autosp explain --model {model} --seq-len {seq_len} "
                                                        f"--sp {sp}: per-rank memory over one step")
        lines.append(f"memory timeline: {got}" if got else
                     "memory timeline skipped: matplotlib is not installed (pip install 'autosp[train]')")
    if full:
        return text + "\n\n" + "\n".join(lines[-2:])
    return "\n".join(lines)
