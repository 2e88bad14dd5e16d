"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine learning rate."""
from __future__ import annotations

import math

import torch


def make_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas=(0.9, 0.95)):
    """torch's AdamW; norms, biases and other vectors are not decayed (the usual GPT recipe)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)


def lr_factor(step: int, *, warmup: int, total: int, floor: float) -> float:
    """Multiplier of the peak rate after `step` updates: linear warmup, then cosine down to `floor`."""
    if step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return 1.0
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def make_schedule(opt, *, warmup: int, total: int, floor: float = 0.1):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup=warmup, total=total, floor=floor))
