"""The model zoo: causal LMs nobody here wrote shard exactly, with Ulysses all-to-alls and no gather.

Tiny random configs of transformers' dense decoders (SDPA, and eager attention where that is the
model's only path), three MoE models (Mixtral with its load-balancing loss, Qwen2-MoE, DeepSeek-V3's
MLA), and a Meta-reference-style Llama with complex RoPE (tests/zoo.py). SP = 2 with a length that P
does not divide (all of them), SP = 4 with one it does (a model per way of laying out heads: GQA and
multi-query with fewer K/V heads than ranks, fused QKV, eager softcapped attention, MLA, MoE, complex
RoPE; the whole zoo at SP = 4 took 40 s of the suite on 2 cores); the loss and every grad of every rank
against the single device (fp32, rtol 1e-5); every rank's program has exactly one all-to-all before and one after
attention in each layer, and no all-gather of the sequence anywhere.
"""
import pytest
import torch

from tests.dist import run_ranks
from tests.models import assert_every_rank
from tests.zoo import NAMES

SP4 = ["meta_llama", "llama", "qwen3", "falcon", "gpt2", "gpt_neox", "gemma2", "mixtral", "deepseek_v3"]


def _zoo_job(rank, world, names, s):
    import autosp
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import rank_errors
    from tests.zoo import case
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    report = {}
    for name in names:
        model, fn, params, (ids, labels), ref, ref_grads = case(name, s)
        vg = autosp.value_and_grad(fn, mesh)
        loss, grads = vg(params, ids, labels)
        (local, *_), = vg.sharded._cache.values()
        layers = model.config.num_hidden_layers if hasattr(model, "config") else len(model.layers)
        report[name] = (rank_errors(loss, grads, ref, ref_grads),
                        sum(e.op.name == "all_to_all" for e in local.eqns),
                        sum(e.op.name == "all_gather_seq" for e in local.eqns), 2 * layers)
    return report


@pytest.mark.parametrize("world,s,names", [(2, 45, NAMES), (4, 48, SP4)], ids=["sp2-odd", "sp4-even"])
def test_zoo_shards_exactly_and_head_parallel(world, s, names):
    reports = run_ranks(_zoo_job, world, names, s, timeout=1800)
    assert_every_rank([{n: r[0] for n, r in report.items()} for report in reports])
    bad = {(f"rank {rank}", n): r[1:] for rank, report in enumerate(reports) for n, r in report.items()
           if not (r[1] == r[3] and r[2] == 0)}
    assert not bad, f"(all-to-alls, sequence gathers, expected all-to-alls): {bad}"
