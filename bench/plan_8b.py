"""Plan remat for an 8B-shaped Llama (meta device, nothing runs) and time each stage.

    .venv/bin/python bench/plan_8b.py [--layers 32] [--seq 32768] [--sp 8] [--budget 0.5]

Stages on rank 0: trace + shard (the forward), the joint graph (forward + backward, traced on
fake tensors), and the plan (problem, ILP, rewrite and simulation). Every rank traces (so on one
machine with few cores the first two stages share the cores SP ways); only the first rank plans,
as autosp does (it broadcasts the plan).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.dist import run_ranks  # noqa: E402


def _job(rank, world, layers, seq, budget, dtype, profile=False):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    import autosp
    from autosp.remat import joint_of, make_plan
    from autosp.remat.cost import device_for
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      attn_implementation="sdpa", torch_dtype=dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    params = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))

    def loss_fn(params, input_ids, labels):
        return torch.func.functional_call(model, params, (input_ids,), {"labels": labels}).loss

    t0 = time.perf_counter()
    _, local = autosp.shard(loss_fn, mesh).graphs(params, ids, ids)
    t1 = time.perf_counter()
    _, joint = joint_of(local)
    torch.distributed.barrier()     # the plan is timed alone, as on a cluster (one rank per GPU's cores)
    if rank != 0:            # autosp plans on the group's first rank and broadcasts; the others wait
        return None
    t2 = time.perf_counter()
    if profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        plan, _ = prof.runcall(make_plan, joint, budget, device_for("cuda"))
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    else:
        plan, _ = make_plan(joint, budget, device_for("cuda"))
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, len(joint.graph.eqns), plan


def main():
    os.environ["AUTOSP_PLAN_CACHE"] = "off"     # planned afresh, not read from the plan cache: the plan stage is timed
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--sp", type=int, default=8)
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", action="store_true", help="cProfile the plan on the planning rank")
    a = ap.parse_args()
    ts, tj, tp, n, plan = run_ranks(_job, a.sp, a.layers, a.seq, a.budget, a.dtype, a.profile, timeout=3600)[0]
    print(plan)
    print(f"\n{a.layers} layers, seq {a.seq}, sp={a.sp}, {a.dtype}, budget {a.budget}: trace + shard {ts:.1f} s, "
          f"joint graph {tj:.1f} s ({n} equations), plan {tp:.1f} s; predicted peak {plan.peak_bytes / 2**30:.2f} "
          f"GiB per rank (no remat {plan.no_remat_peak_bytes / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
