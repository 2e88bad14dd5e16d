"""Token-dispatch regions (autosp/passes/dispatch.py): MoE experts on rows sorted by expert.

A region is found where a sort of the routed rows is undone by its inverse permutation and the
counts only become grouped_mm's offsets; a region whose counts are used otherwise (here: to
normalise by tokens per expert, which needs every rank's tokens) is not one, and keeps the
ordinary rules. The sharded result of the real models is checked in tests/test_zoo.py.
"""
import pytest
import torch
import torch.nn.functional as F

import autosp
from autosp.passes.dispatch import find_dispatch_regions
from autosp.passes.functionalize import functionalize
from autosp.passes.seqdims import SeqPos, infer_seq_positions
from autosp.passes.shard import input_free

grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
pytestmark = pytest.mark.skipif(grouped_mm is None, reason="this torch has no grouped_mm")

E, K = 4, 2


def moe(x, router, experts, normalise=False):
    """transformers' grouped_mm experts, reduced: x (s, d) -> (s, n)."""
    w, ids = (x @ router).softmax(-1).topk(K)                       # (s, K)
    ids_g, perm = torch.sort(ids.reshape(-1))                       # (s K,)
    rows = x[perm // K]
    counts = torch.histc(ids_g.float(), bins=E, min=0, max=E - 1)
    out = grouped_mm(rows, experts, offs=torch.cumsum(counts, 0, dtype=torch.int32))
    if normalise:
        out = out / counts[ids_g].unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0))
    out = out[inv] * w.reshape(-1, 1)
    return out.view(x.shape[0], K, -1).sum(1)


def _regions(normalise):
    g = torch.Generator().manual_seed(0)
    x, router, experts = torch.randn(16, 8, generator=g), torch.randn(8, E, generator=g), torch.randn(E, 8, 12, generator=g)
    graph = functionalize(autosp.trace(lambda a, b, c: moe(a, b, c, normalise), x, router, experts))
    pos = infer_seq_positions(graph, {graph.inputs[0].name: SeqPos(0)})
    return graph, find_dispatch_regions(graph, pos, input_free(graph))


def test_dispatch_region_spans_sort_to_unsort():
    graph, regions = _regions(normalise=False)
    assert len(regions) == 1
    names = [graph.eqns[k].op.name for k in sorted(regions[0].eqns)]
    assert names[0] == "sort" and names[-1] == "index" and "grouped_mm" in names and "histc" in names
    assert "topk" not in names and "sum" not in names          # routing and combine keep their own rules


def test_counts_used_beyond_offsets_make_no_region():
    _, regions = _regions(normalise=True)
    assert regions == []
