"""AdamW with decoupled weight decay on matrices only (or plain SGD), and a warmup + cosine learning rate.

    opt = make_optimizer(model, lr=3e-3, weight_decay=0.1)                 # torch's fused AdamW on the parameters
    opt = make_optimizer(model, lr=3e-3, weight_decay=0.1, offload=True)   # the same AdamW on host copies

The parameters may be DTensors (autosp.shard_params): AdamW then steps the local shards, and its
moments are DTensors laid out as their parameter. AdamW is torch's fused kernel: it updates in place
and allocates nothing beyond its moments, so the optimizer's step adds no bytes to what the planner
counts (parameters, gradients, moments). `offload=True` is ZeRO-Offload's split: `OffloadedAdamW`
keeps fp32 master weights, gradients and moments of this rank's shards in host memory (pinned for a
GPU; on CPU outside torch's allocator, as the activation offload's pool) and steps them with torch's
CPU AdamW; the device keeps the parameters and, until the step, their gradients.
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
    from autosp.remat.offload import host_empty
    return host_empty(tuple(like.shape), torch.float32, pin=like.device.type == "cuda")


def _fused() -> dict:
    """AdamW's fused kernel where this torch has it for CPU tensors (2.4 and later): no temporaries."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices
    return {"fused": True} if "cpu" in _get_fused_kernels_supported_devices() else {}


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
        for m in self.masters:          # the moments in host buffers too (AdamW would allocate them with torch)
            self.state[m] = {"step": torch.tensor(0.0), "exp_avg": _host(m).zero_(), "exp_avg_sq": _host(m).zero_()}

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

    def named_masters(self, model: torch.nn.Module) -> dict:
        """The fp32 masters by parameter name (tied names too), laid out as the device parameters: what a
        checkpoint holds as the model's weights (in bf16 the device's copy is rounded; the masters are not)."""
        index = {id(p): i for i, p in enumerate(self.device_params)}
        return {n: self._as_param(index[id(p)], self.masters[index[id(p)]])
                for n, p in model.named_parameters(remove_duplicate=False) if id(p) in index}

    def load_named_state(self, sd: dict) -> None:
        """The inverse of `named_state`; the masters must already hold the checkpoint's weights (loaded
        through `named_masters`); the device parameters are then written from them."""
        index = {n: i for i, n in enumerate(self.names)}
        state = {index[n]: {k: _local(v) for k, v in s.items()} for n, s in sd["state"].items()}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]]
        self.load_state_dict({"state": state, "param_groups": groups})
        self.sync_to_device()


def make_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas=(0.9, 0.95),
                   offload: bool = False, kind: str = "adamw"):
    """torch's fused AdamW; norms, biases and other vectors are not decayed (the usual GPT recipe).
    offload=True: OffloadedAdamW, the same update on fp32 host copies. kind="sgd": torch's SGD without
    momentum (no state; its weight decay is the L2 term)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if offload:
        return OffloadedAdamW(model, groups, lr=lr, betas=betas, **_fused())
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **_fused())


def state_bytes(model: torch.nn.Module, *, offload: bool = False, moments: int = 2) -> tuple[int, int]:
    """(device, host) bytes this rank holds for the parameters, their gradients and the optimizer's `moments`
    fp32 moments (local shards of sharded parameters); offloaded, the host holds fp32 masters, gradients and
    moments."""
    local = [_local(p.detach()) for p in model.parameters() if p.requires_grad]
    params = sum(t.numel() * t.element_size() for t in local)
    n = sum(t.numel() for t in local)
    if not offload:
        return 2 * params + 4 * moments * n, 0
    return 2 * params, 4 * (2 + moments) * n


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
