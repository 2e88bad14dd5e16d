"""The training step's loss as the mean over the labelled tokens of the whole global batch: every dp rank, every
micro-step, whatever each holds.

    loss_fn = token_mean_loss(model)                      # (params, ids, labels, positions, per_rank) -> loss
    loss = accumulated_step(step_fn, params, micro)       # value_and_grad(loss_fn, mesh)'s step over micro-batches

A sharded step's scalar output is averaged over dp (autosp.passes.shard: all-reduce, divide by dp), the gradients
likewise: each dp rank's loss counts 1/D, whatever its token count. Where the counts differ (chat data's answers,
packed documents' first tokens) a mean of per-rank means is not the mean over the tokens. So the count of labelled
tokens of the global batch, T, is summed over the ranks before the step (one all-reduce of a number), and each rank's
loss is its sum of token losses divided by T/D (transformers' `num_items_in_batch`, the loss's own `reduction="sum"`
path): the dp average then gives the sum over every token of the global batch divided by T, and its gradient is
that mean's. Micro-steps add up (each is already divided by the whole T). A batch with no labelled token at all (a
prompt that fills the sequence, its answer cut off) divides a zero sum by 1: loss 0, gradients 0, never NaN.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def label_count(labels: torch.Tensor) -> int:
    """Tokens the model is asked to predict: labels it shifts by one, -100 ignored."""
    return int((labels[:, 1:] != -100).sum())


def token_mean_loss(model):
    """The step's loss function: the causal LM's summed next-token loss divided by `per_rank` (T/D)."""
    from autosp.run.plan import step_loss

    def loss_fn(params, input_ids, labels, position_ids, per_rank):
        return step_loss(model, params, input_ids, labels, position_ids, num_items=per_rank)
    return loss_fn


def global_count(counts: list[int], sp: int) -> int:
    """The labelled tokens of the global batch, from this rank's per micro-batch `counts`: summed over every rank,
    each dp rank's counted by its sp ranks alike."""
    total = torch.tensor([float(sum(counts))], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
        return int(round(float(total) / sp))
    return int(total)


def per_rank(total: int, dp: int, like: torch.Tensor) -> torch.Tensor:
    """The divisor of each rank's summed loss, T/D (1/D where T is 0: the zero sum stays 0), as a float32 scalar on
    the batch's device."""
    return torch.tensor(max(total, 1) / dp, dtype=torch.float32, device=like.device)


def with_divisor(micro: list[tuple], sp: int, dp: int) -> list[tuple]:
    """Each micro-batch (ids, labels, positions) with the divisor of the global batch appended."""
    total = global_count([label_count(labels) for _, labels, _ in micro], sp)
    return [(*m, per_rank(total, dp, m[0])) for m in micro]


def accumulated_step(step_fn, params: dict, micro: list[tuple]):
    """The loss of a step over its micro-batches (each with_divisor's), their gradients summed into each
    parameter's .grad: the mean over the global batch's labelled tokens and its gradient."""
    loss = None
    for batch in micro:
        part, grads = step_fn(params, *batch)
        loss = part if loss is None else loss + part
        add_grads(params, grads)
        del grads
    return loss


def add_grads(params: dict, grads: dict, weight: float | None = None) -> None:
    """A micro-step's gradients (times `weight`) summed into each parameter's .grad (set on the first)."""
    for name, p in params.items():
        g = grads[name] if weight is None else grads[name] * weight
        p.grad = g if p.grad is None else p.grad.add_(g)


def evaluate(sharded, params: dict, batches: list[tuple], sp: int, dp: int) -> float | None:
    """The mean loss over the labelled tokens of held-out `batches` (this rank's part of each: ids, labels,
    positions), forward only, weighted by each batch's global count; None when no batch has a labelled token."""
    counts = torch.tensor([float(label_count(labels)) for _, labels, _ in batches], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    counts = (counts / sp).round()
    if float(counts.sum()) == 0:
        return None
    total = 0.0
    with torch.no_grad():
        for batch, count in zip(batches, counts.tolist()):
            loss = sharded(params, *batch, per_rank(int(count), dp, batch[0]))
            total += float(loss) * count
    return total / float(counts.sum())
