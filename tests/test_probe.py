"""Ops no rule names: a probe finds where the sequence goes and whether the op keeps positions apart."""
import torch

from tests.dist import run_ranks
from tests.models import assert_every_rank


@torch.library.custom_op("autosp_test::rowwise", mutates_args=())
def rowwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Position-wise along dim 1 of x [b, s, d], but no rule knows it."""
    return torch.tanh(x) * w


@rowwise.register_fake
def _(x, w):
    return torch.empty_like(x)


def _rowwise_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _rowwise_backward(ctx, g):
    x, w = ctx.saved_tensors
    t = torch.tanh(x)
    return g * (1 - t * t) * w, (g * t).reshape(-1, w.shape[-1]).sum(0)


rowwise.register_autograd(_rowwise_backward, setup_context=_rowwise_setup)


@torch.library.custom_op("autosp_test::running", mutates_args=())
def running(x: torch.Tensor) -> torch.Tensor:
    """Mixes positions along dim 1 (a running sum)."""
    return x.cumsum(1)


@running.register_fake
def _(x):
    return torch.empty_like(x)


def _attention_loss(op):
    import torch.nn.functional as F

    def loss(p, x):
        h = op(x @ p["w"], p["g"]) if op is rowwise else op(x @ p["w"])
        q = h.view(*h.shape[:2], 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).pow(2).mean()
    return loss


def _job(rank, world):
    import autosp
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import rank_errors
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 8, generator=g), "g": torch.randn(8, generator=g)}
    x = torch.randn(2, 13, 8, generator=g)
    fn = _attention_loss(rowwise)
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref = fn(p, x)
    ref_grads = dict(zip(p, torch.autograd.grad(ref, list(p.values()))))
    loss, grads = autosp.value_and_grad(fn, mesh)(params, x)
    try:
        autosp.value_and_grad(_attention_loss(running), mesh)(params, x)
        mixed = None
    except autosp.AutospError as exc:
        mixed = str(exc)
    return {"rowwise": rank_errors(loss, grads, ref, ref_grads)}, mixed


def test_probe_shards_an_unknown_positionwise_op_and_refuses_a_mixing_one():
    results = run_ranks(_job, 2)
    assert_every_rank([errors for errors, _ in results])
    for rank, (_, mixed) in enumerate(results):
        assert mixed is not None and "mixes positions along the sequence" in mixed and "running" in mixed, \
            (rank, mixed)
