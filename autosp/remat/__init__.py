"""Sequence-aware activation checkpointing: one ILP over the joint graph chooses, for every
forward value the backward reads, to save, recompute or offload it under a memory budget.

    joint    passes/autodiff.py   the sharded forward differentiated into one IR program
    model    liveness.py          bytes per rank over the executed order (storage-aware)
             cost.py              seconds per equation (FLOPs, bytes, links)
    problem  problem.py           IlpProblem: variables, availability rows, memory intervals
    solve    solve.py             HiGHS with lazy memory rows; brute force for tests
    apply    apply.py             the plan -> forward and backward programs
    plan     plan.py              Plan (data, printable), the budget loop, simulate_step
    run      runtime.py           the programs as one autograd.Function
"""
from __future__ import annotations

from autosp.remat.plan import BudgetError, Decision, Plan, make_plan, parse_budget, parse_host_memory, simulate_step

__all__ = ["BudgetError", "Decision", "Plan", "compile_step", "make_plan", "parse_budget", "parse_host_memory",
           "plan_step", "simulate_step"]


_JOINTS: dict = {}          # the last few joint graphs, by the sharded graph they differentiate


def joint_of(local):
    """(StepBoundary, Joint) of a sharded forward graph, cached: planning the same step under several
    budgets traces its backward once."""
    from autosp.passes.autodiff import differentiate, split_boundary
    key = (str(local), tuple(id(t) for _, t in local.consts))
    hit = _JOINTS.get(key)
    if hit is None:
        boundary = split_boundary(local)
        hit = (boundary, differentiate(boundary.graph))
        if len(_JOINTS) >= 4:
            _JOINTS.pop(next(iter(_JOINTS)))
        _JOINTS[key] = hit
    return hit


def plan_step(local, memory_budget, *, device: str = "cpu", host_bandwidth=None, host_memory=None,
              offload: bool | None = None, refine: bool = True):
    """(Plan, Program, Joint, StepBoundary) for a sharded forward graph; runs nothing. The one planning
    entry of autosp.plan, autosp.explain and the command line. `offload`: None plans offload where the
    device has a host link (a GPU, or `host_bandwidth`), False never; `host_memory`: bytes per rank
    (or '64GiB') the offloaded values may take, None no limit; `refine`: make_plan's."""
    from dataclasses import replace

    from autosp.remat.cost import device_for
    boundary, joint = joint_of(local)
    dev = device_for(device, host_bandwidth)
    if offload is False:
        dev = replace(dev, host_bw=None)
    plan, program = make_plan(joint, memory_budget, dev, offload=dev.host_bw is not None, host_memory=host_memory,
                              refine=refine)
    return plan, program, joint, boundary


def compile_step(local, memory_budget, *, device: str = "cpu", host_bandwidth=None, host_memory=None,
                 group: str | None = None):
    """(Plan, runner): the step that runs the plan. With a process group, its first rank plans and
    broadcasts the plan (recomputed collectives must match across ranks, and a shared host plans
    once); a refused budget is raised on every rank."""
    import torch.distributed as dist
    from autosp.collectives import _pg
    from autosp.remat.apply import apply_plan
    from autosp.remat.cost import device_for
    from autosp.remat.runtime import Runner
    boundary, joint = joint_of(local)
    dev = device_for(device, host_bandwidth)
    pg = _pg(group) if group is not None else None
    if pg is None or dist.get_world_size(pg) == 1:
        plan, program = make_plan(joint, memory_budget, dev, offload=dev.host_bw is not None,
                                  host_memory=host_memory)
        return plan, Runner(program, joint, boundary)
    box = [None]
    if dist.get_rank(pg) == 0:
        try:
            plan, program = make_plan(joint, memory_budget, dev, offload=dev.host_bw is not None,
                                      host_memory=host_memory)
            recomputed = _recomputed(joint, program)
            box = [(plan, tuple(program.saved), recomputed, tuple(program.offloaded))]
        except Exception as exc:  # noqa: BLE001 - every rank raises what the planning rank raised
            box = [exc]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    if isinstance(box[0], Exception):
        raise box[0]
    plan, saved, recomputed, offloaded = box[0]
    program = apply_plan(joint, saved, recomputed, offloaded)
    return plan, Runner(program, joint, boundary)


def _recomputed(joint, program) -> tuple[int, ...]:
    fwd = set(program.backward.eqns)
    return tuple(k for k, e in enumerate(joint.forward_eqns) if e in fwd)
