"""DeepSeek-V3.2's sparse attention shards exactly: the indexer scores each query against every key and keeps
its top k, so its values hold two sequence dims; each rank runs its own queries against the index keys read
whole, and attention runs those queries against keys and values read whole with the mask's rows it made.

tests/zoo.py HF_2026 "deepseek_v32": MLA, an indexer of 2 heads keeping 8 keys per query (fewer than s), MoE on
layer 1, fp32, its torch path. Loss and every grad of every rank against the single device (rtol 1e-5), at sp 2
with a length it does not divide (45) and sp 4 (50); each program's collectives counted.
"""
import pytest
import torch

from tests.dist import run_ranks
from tests.models import assert_every_rank


def _job(rank, world, s):
    import autosp
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import batch, rank_errors
    from tests.zoo import build
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    model, fn = build("deepseek_v32")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids, labels = batch(2, s, 64, seed=1, pad=3)
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    ref = fn(p, ids, labels)
    ref_grads = dict(zip(params, torch.autograd.grad(ref, list(p.values()), allow_unused=True)))
    vg = autosp.value_and_grad(fn, mesh)
    loss, grads = vg(params, ids, labels)
    (local, *_), = vg.sharded._cache.values()
    counts = {}
    for e in local.eqns:
        if e.op.name in ("all_to_all", "all_gather_seq"):
            counts[e.op.name] = counts.get(e.op.name, 0) + 1
    return rank_errors(loss, grads, ref.detach(), ref_grads), counts


@pytest.mark.parametrize("world,s", [(2, 45), (4, 50)], ids=["sp2-odd", "sp4"])
def test_deepseek_v32_sparse_attention_exact(world, s):
    reports = run_ranks(_job, world, s, timeout=600)
    assert_every_rank([{"deepseek_v32": r[0]} for r in reports])
    for rank, (_, counts) in enumerate(reports):
        assert counts == EXPECTED, f"rank {rank}: collectives {counts}, expected {EXPECTED}"


# per layer: the index keys, K and V gathered whole; no all-to-all (no attention runs head-parallel)
EXPECTED = {"all_gather_seq": 6}


def test_two_sequence_values_keep_the_query_dim():
    """Every layer's indexer scores (`[b, s, heads, s]`, then `[b, s, 1, s]`) have the rows as their sequence,
    whichever side the search reaches them from (the second layer's from the keys first)."""
    from autosp.passes.shard import analyse
    from autosp.passes.shard_ctx import MeshInfo
    from autosp.trace import trace
    from tests.models import batch
    from tests.zoo import build
    model, fn = build("deepseek_v32")
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids, labels = batch(1, 40, 64, seed=1)
    graph = trace(fn, params, ids, labels)
    pos = analyse(graph, MeshInfo(2, "sp")).pos
    scores = [e.outputs[0] for e in graph.eqns if e.op.name == "matmul" and e.outputs[0].shape[-1] == 40]
    assert len(scores) == 4
    assert all(pos[v.name].dim == 1 for v in scores), [(v, pos.get(v.name)) for v in scores]
