"""The model zoo: causal LMs nobody here wrote shard exactly, with Ulysses all-to-alls and no gather.

Tiny random configs of transformers' dense decoders (SDPA, and eager attention where that is the
model's only path), three MoE models (Mixtral with its load-balancing loss, Qwen2-MoE, DeepSeek-V3's
MLA), and a Meta-reference-style Llama with complex RoPE (tests/zoo.py). SP = 2 with a length that P
does not divide, SP = 4 with one it does; loss and every grad against the single device (fp32,
rtol 1e-5); the per-rank program has exactly one all-to-all before and one after attention in each
layer, and no all-gather of the sequence anywhere.
"""
import pytest
import torch

from tests.dist import run_ranks
from tests.zoo import NAMES

RTOL = 1e-5


def _zoo_job(rank, world, names, s):
    import autosp
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import batch
    from tests.zoo import build
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    report = {}
    for name in names:
        model, fn = build(name)
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        ids, labels = batch(2, s, 64, seed=1, pad=3)
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        ref = fn(p, ids, labels)
        ref_grads = torch.autograd.grad(ref, list(p.values()), allow_unused=True)
        vg = autosp.value_and_grad(fn, mesh)
        loss, grads = vg(params, ids, labels)
        worst = abs(loss.item() - ref.item()) / abs(ref.item())
        for k, g in zip(params, ref_grads):
            if g is not None:
                worst = max(worst, ((grads[k] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item())
        (local, _, _), = vg.sharded._cache.values()
        layers = model.config.num_hidden_layers if hasattr(model, "config") else len(model.layers)
        report[name] = (worst, sum(e.op.name == "all_to_all" for e in local.eqns),
                        sum(e.op.name == "all_gather_seq" for e in local.eqns), 2 * layers)
    return report


@pytest.mark.parametrize("world,s,names", [(2, 45, NAMES), (4, 48, NAMES)], ids=["sp2-odd", "sp4-even"])
def test_zoo_shards_exactly_and_head_parallel(world, s, names):
    report = run_ranks(_zoo_job, world, names, s, timeout=1800)[0]
    bad = {n: r for n, r in report.items() if not (r[0] <= RTOL and r[1] == r[3] and r[2] == 0)}
    assert not bad, f"(max relative error, all-to-alls, sequence gathers, expected all-to-alls): {bad}"

