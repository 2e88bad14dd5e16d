"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine learning rate.

    opt = make_optimizer(model, lr=3e-3, weight_decay=0.1)                 # torch's AdamW on the parameters
    opt = make_optimizer(model, lr=3e-3, weight_decay=0.1, offload=True)   # the same AdamW on host copies

The parameters may be DTensors (autosp.shard_params): AdamW then steps the local shards, and its
moments are DTensors laid out as their parameter. `offload=True` is ZeRO-Offload's split:
`OffloadedAdamW` keeps fp32 master weights, gradients and moments of this rank's shards in host
memory and steps them with torch's CPU AdamW; the device keeps the parameters and, until the
step, their gradients.
"""
from __future__ import annotations

import math

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient (a DTensor's local shard; the tensor itself otherwise).
    Under no_grad a DTensor's local shard is its storage, so writing it writes the parameter."""
    from autosp.params import is_dtensor
    return t.to_local() if is_dtensor(t) else t


def _host(like: torch.Tensor) -> torch.Tensor:
    """An fp32 host buffer shaped as `like`, pinned when `like` is on a GPU (asynchronous copies)."""
    return torch.empty(like.shape, dtype=torch.float32, pin_memory=like.device.type == "cuda")


class OffloadedAdamW(torch.optim.AdamW):
    """torch's AdamW over fp32 host copies of the device parameters (ZeRO-Offload).

    `step()` copies each gradient's local shard to host and drops it from the device, steps AdamW on
    the host masters, and copies the masters back into the device parameters' local shards.
    `zero_grad()` clears the device gradients (the host buffers are reused). In state dicts it reads
    as the AdamW of the device parameters (`named_state`, `load_named_state`), so checkpoints load
    into either kind of run and DCP reshards the moments."""

    def __init__(self, model: torch.nn.Module, groups: list[dict], **kwargs):
        names = {id(p): n for n, p in model.named_parameters()}
        self.device_params = [p for g in groups for p in g["params"]]
        self.names = [names[id(p)] for p in self.device_params]
        with torch.no_grad():
            self.masters = [_host(_local(p)).copy_(_local(p)) for p in self.device_params]
        masters = iter(self.masters)
        super().__init__([{**g, "params": [next(masters) for _ in g["params"]]} for g in groups], **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        for p, m in zip(self.device_params, self.masters):
            if p.grad is None:
                m.grad = None
                continue
            if m.grad is None:
                m.grad = _host(m)
            m.grad.copy_(_local(p.grad), non_blocking=True)
            p.grad = None                        # the device's copy is no longer needed
        if any(p.device.type == "cuda" for p in self.device_params):
            torch.cuda.synchronize()             # the gradients are on host before the CPU reads them
        loss = super().step(closure)
        self.sync_to_device()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.device_params:
            p.grad = None

    @torch.no_grad()
    def sync_to_device(self) -> None:
        for p, m in zip(self.device_params, self.masters):
            _local(p).copy_(m, non_blocking=True)

    @torch.no_grad()
    def sync_from_device(self) -> None:
        """Masters from the device parameters (after a checkpoint was loaded into the model)."""
        for p, m in zip(self.device_params, self.masters):
            m.copy_(_local(p))

    def _as_param(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """A host tensor of parameter i laid out as the device parameter (a DTensor over host memory when
        it is one), the form torch.distributed.checkpoint reshards."""
        from torch.distributed.tensor import DTensor

        from autosp.params import is_dtensor
        p = self.device_params[i]
        if not is_dtensor(p):
            return t
        return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    def named_state(self) -> dict:
        """The state as `get_state_dict(model, torch_adamw)` gives it: keyed by parameter name, moments laid
        out as their parameter. Parameters without state yet get zeros (a template for loading into)."""
        sd = self.state_dict()
        state = {}
        for i, (name, m) in enumerate(zip(self.names, self.masters)):
            s = sd["state"].get(i) or {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m),
                                       "exp_avg_sq": torch.zeros_like(m)}
            state[name] = {k: v if k == "step" else self._as_param(i, v) for k, v in s.items()}
        groups = [{**g, "params": [self.names[i] for i in g["params"]]} for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_named_state(self, sd: dict) -> None:
        """The inverse of `named_state`; the masters are then read from the device parameters, which
        must already hold the checkpoint's values."""
        index = {n: i for i, n in enumerate(self.names)}
        state = {index[n]: {k: _local(v) for k, v in s.items()} for n, s in sd["state"].items()}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]]
        self.load_state_dict({"state": state, "param_groups": groups})
        self.sync_from_device()


def make_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas=(0.9, 0.95),
                   offload: bool = False):
    """torch's AdamW; norms, biases and other vectors are not decayed (the usual GPT recipe).
    offload=True: OffloadedAdamW, the same update on fp32 host copies."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if offload:
        return OffloadedAdamW(model, groups, lr=lr, betas=betas)
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def state_bytes(model: torch.nn.Module, *, offload: bool = False) -> tuple[int, int]:
    """(device, host) bytes this rank holds for the parameters, their gradients and AdamW's two moments
    (local shards of sharded parameters); offloaded, the host holds fp32 masters, gradients and moments."""
    local = [_local(p.detach()) for p in model.parameters() if p.requires_grad]
    params = sum(t.numel() * t.element_size() for t in local)
    if not offload:
        return 4 * params, 0
    return 2 * params, 4 * 4 * sum(t.numel() for t in local)


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
