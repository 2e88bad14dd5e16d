"""Bad input gets an AutospError naming the op, the source line, the layouts, the mesh and the fix."""
import torch
import torch.nn.functional as F

from tests.dist import run_ranks


def _attn_then(op):
    def fn(w, x):
        h = x @ w                                               # [b, s, 8]
        q = h.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return op(a.transpose(1, 2).reshape(h.shape))
    return fn


def _messages(rank, world):
    import autosp
    from torch.distributed.device_mesh import init_device_mesh
    from tests.models import batch, llama_loss, params_of, tiny_llama
    out = {}

    def capture(key, thunk):
        try:
            thunk()
            out[key] = None
        except autosp.AutospError as exc:
            out[key] = str(exc)

    torch.manual_seed(0)                            # the same parameters on every rank
    sp = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = tiny_llama()
    fn, params = llama_loss(model), params_of(model)
    ids, labels = batch(2, 32, 64)
    capture("no_sp", lambda: autosp.shard(fn, tp))
    capture("arity", lambda: autosp.shard(fn, sp)(params, ids))
    capture("values_differ", lambda: autosp.shard(fn, sp)(params, *batch(2, 32, 64, seed=rank)))
    mine = batch(2, 32 if rank == 0 else 16, 64)
    capture("ranks_differ", lambda: autosp.shard(fn, sp)(params, *mine))
    capture("label_shape", lambda: autosp.shard(fn, sp)(params, ids, labels[:, :-2]))
    g = torch.Generator().manual_seed(0)             # the same global values on every rank
    w, x = torch.randn(8, 8, generator=g), torch.randn(2, 16, 8, generator=g)
    capture("no_rule", lambda: autosp.shard(_attn_then(lambda a: a.cummax(dim=1).values.sum()), sp)(w, x))
    # sorting along the sequence has a rule: the exact gather
    by_pos = _attn_then(lambda a: (a.sort(dim=1).values * torch.arange(16.0).view(1, 16, 1)).sum())
    out["sort_value"] = (autosp.shard(by_pos, sp)(w, x).item(), by_pos(w, x).item())
    # 3 heads at sp=2 run a ring (sp = 1 x 2), with a sliding-window mask too (the mask as a function);
    # a mask that is no function of positions (read from an input) is refused on the ring
    odd = tiny_llama(heads=3, kv_heads=3, hidden=24)
    out["heads_value"] = (autosp.shard(llama_loss(odd), sp)(params_of(odd), ids, labels).item(),
                          llama_loss(odd)(params_of(odd), ids, labels).item())
    from tests.models import tiny_hf
    window = tiny_hf("mistral", heads=3, kv_heads=3, hidden=24, sliding_window=4)
    out["window_value"] = (autosp.shard(llama_loss(window), sp)(params_of(window), ids, labels).item(),
                           llama_loss(window)(params_of(window), ids, labels).item())
    w6, x6 = torch.randn(6, 6, generator=g), torch.randn(2, 16, 6, generator=g)
    keep = torch.rand(2, 1, 16, 16, generator=g) > 0.3
    keep |= torch.eye(16, dtype=torch.bool)

    def three_heads(w, x, m):
        q = (x @ w).view(2, 16, 3, 2).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=m).sum()
    capture("heads", lambda: autosp.shard(three_heads, sp)(w6, x6, keep))
    capture("no_attention", lambda: autosp.shard(lambda w, x: (x @ w).sum(), sp)(w, x))
    capture("bad_spec", lambda: autosp.shard(lambda w, x: (x @ w).sum(), sp, in_specs=(None, "b (s d"))(w, x))
    capture("spec_rank", lambda: autosp.shard(lambda w, x: (x @ w).sum(), sp, in_specs=(None, "b s"))(w, x))
    # in_specs make a function without attention shardable, and exact
    got = autosp.shard(lambda w, x: (x @ w).sum(), sp, in_specs=(None, "b s d"))(w, x)
    out["spec_value"] = (got.item(), (x @ w).sum().item())
    return out


def test_error_messages():
    results = run_ranks(_messages, 2)
    for rank, r in enumerate(results):          # the values that ran: on every rank
        for key in ("sort_value", "spec_value", "heads_value", "window_value"):
            got, want = r[key]
            assert abs(got - want) <= 1e-5 * abs(want), (rank, key, got, want)
    m = results[0]
    assert "no 'sp' axis" in m["no_sp"] and "Fix" in m["no_sp"]
    assert "missing" in m["arity"] and "Fix" in m["arity"]
    assert "sp rank 0 and sp rank 1 passed arguments of different shapes" in m["ranks_differ"]
    assert "passed different values for argument [1]" in m["values_differ"] and "Fix" in m["values_differ"]
    assert "could not trace" in m["label_shape"] and "loss_utils.py" in m["label_shape"] and "Fix" in m["label_shape"]
    nr = m["no_rule"]
    assert "cummax" in nr and "mixes positions" in nr and "test_shard_errors.py" in nr and "(sp s)" in nr \
        and "sp=2" in nr and "Fix" in nr
    assert "3 query heads cannot be split over sp=2" in m["heads"] and "a mask that is not such a function" \
        in m["heads"] and "Fix" in m["heads"], m["heads"]
    assert "no attention" in m["no_attention"] and "in_specs" in m["no_attention"]
    assert "layout spec 'b (s d'" in m["bad_spec"]
    assert "names 2 dims but the value has shape [2, 16, 8]" in m["spec_rank"]
