"""`autosp eval` on preference pairs: how often the model prefers the chosen answer, sequence-parallel.

    autosp eval --model runs/dpo --data held-pairs.jsonl --seq-len 1024 --sp 2 --reference models/base
    autosp eval --model runs/dpo --data held-pairs.jsonl --seq-len 1024 --sp 2      # no reference: log-probabilities

Every held-out pair (up to --batches batches of --batch pairs) runs its chosen and rejected sequence through
`dpo.sequence_logps` under `autosp.shard`, forward only. With `--reference MODEL` (the model the run started from:
a preset, a model folder or a run folder) a pair counts as preferred when DPO's implicit reward of the chosen answer
is above the rejected one's, beta ((pc - rc) - (pr - rr)) > 0, and the margin is that quantity's mean; without one,
when the policy's own log-probability of the chosen answer is above the rejected one's, pc - pr > 0 (the answers'
lengths weigh in then). eval.json says which (`against`).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist


def _reference_model(a, dev):
    """The --reference model, built as `autosp eval --model` builds its model (a run's checkpoint, a folder's
    weights, a preset's random init from --seed)."""
    from autosp.run.checkpoint import checkpoints
    from autosp.run.models import build_model, spec_of
    if checkpoints(a.reference):
        from autosp.run.export import load_run
        model, _ = load_run(a.reference)
        return model.to(dev)
    return build_model(spec_of(replace(a.step, model=a.reference)), seed=a.seed, device=str(dev))


def evaluate(a, model, params, mesh, dp_rank: int, dp: int, dev, autosp) -> dict:
    """eval.json's figures for the pairs of a.inputs (dpo.PairInputs)."""
    from autosp.run.dpo import sequence_logps
    from autosp.run.pairs import rows_batch
    step, cache = a.step, a.inputs.pairs
    policy = autosp.shard(lambda p, ids, labels: sequence_logps(model, p, ids, labels), mesh)
    ref = None
    if a.reference:
        ref_model = _reference_model(a, dev).eval()
        if step.precision != "fp32":
            ref_model = ref_model.to(step.dtype)
        ref_params = {k: v.detach() for k, v in ref_model.named_parameters()}
        ref = autosp.shard(lambda p, ids, labels: sequence_logps(ref_model, p, ids, labels), mesh)
    batch = step.global_batch
    order = list(range(cache.pairs))
    batches = min(a.batches, -(-len(order) // batch))
    order += [0] * (batches * batch - len(order))        # the last batch filled with pair 0, weighed 0
    weight = np.zeros(len(order))
    weight[:min(cache.pairs, len(order))] = 1
    # per dp rank: sums of [weight, weight * preferred, weight * margin, weight * pc, weight * pr]
    sums = torch.zeros(5, dtype=torch.float64)
    with torch.no_grad():
        for b in range(batches):
            rows = order[b * batch:(b + 1) * batch]
            mine = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)
            _, ids, labels = rows_batch(cache, rows[mine])
            ids, labels = torch.from_numpy(ids).to(dev), torch.from_numpy(labels).to(dev)
            lp = policy(params, ids, labels).double().cpu().view(2, -1)
            z = lp[0] - lp[1]
            if ref is not None:
                rp = ref(ref_params, ids, labels).double().cpu().view(2, -1)
                z = step.beta * (z - (rp[0] - rp[1]))
            w = torch.from_numpy(weight[b * batch:(b + 1) * batch][mine])
            sums += torch.stack([w.sum(), (w * (z > 0)).sum(), (w * z).sum(), (w * lp[0]).sum(), (w * lp[1]).sum()])
    dist.all_reduce(sums)                      # every sp rank holds its dp rank's sums: each pair counted sp times
    n = float(sums[0])
    against = (f"the reference {a.reference}: DPO's implicit reward, beta {step.beta:g} ((pc - rc) - (pr - rr)) > 0"
               if ref is not None else "no reference: the policy's log-probabilities, pc - pr > 0 (pass --reference "
               "MODEL, the model the run started from, for DPO's implicit reward)")
    return {"kind": "preference", "model": step.model, "data": cache.name, "seq_len": step.seq_len, "sp": step.sp,
            "pairs": int(round(n / step.sp)), "accuracy": float(sums[1]) / n, "margin": float(sums[2]) / n,
            "chosen_logp": float(sums[3]) / n, "rejected_logp": float(sums[4]) / n, "beta": step.beta,
            "reference": a.reference, "against": against}


def lines(r: dict) -> list[str]:
    """What `autosp eval` prints of a preference result."""
    return [f"autosp eval: {r['model']} on {r['data']}: {r['pairs']} pairs of {r['seq_len']:,} tokens, sp {r['sp']}",
            f"  preference accuracy {r['accuracy']:.4f}, mean margin {r['margin']:.4f} (against {r['against']})",
            f"  mean log-probability of the chosen answers {r['chosen_logp']:.3f}, of the rejected {r['rejected_logp']:.3f}"]
