"""The whole training step on one GPU (sp = 1): every way autosp can run it, measured against its own plan.

An HF Llama with Llama 3.2 1B's shapes (hidden 2048, 32 heads, 8 KV heads, MLP 8192, vocab 128256; --layers of
them, 4 by default so that inductor compiles it within the GPU check's budget), bf16 parameters, one sequence of
--seq tokens (32K by default). Each configuration runs a compiling step, then --steps measured steps:

    eager 1.0          the plan at memory_budget=1.0 (what autograd saves), the flash kernel in the step
    eager 0.5          half of that peak: recomputation and the tiled loss/MLP chains where the planner needs them
    eager least        the least peak the planner reaches
    eager least untiled  the least with tiles={} (no chain tiled): what tiling buys
    compiled 0.5       0.5 through inductor (compile=True)
    compiled 1.0, compiled least  the same at 1.0 and at the least (not in bench/gpu_check.sh: at the least the
                       program is cut into many segments near its peak: 46 + 419 at 32K, 17 + 61 different op
                       sequences, each compiled cold)
    offload least      the least with activations offloaded through the pinned pool on a side stream, the host
                       link taken as 50 GB/s: the planner offloads where that is cheaper than recomputing (at 32K
                       it is nowhere; at 131,072 tokens on 2 layers, 3.99 GiB)
    offload 0.5 fast link  0.5 planned as if the host link were free (1e13 B/s): the planner offloads instead of
                       recomputing (7.14 GiB at 32K), so the step against eager 1.0 (nothing recomputed) shows what
                       the real copies cost once overlapped, and its loss that the side stream's copies are exact
    compiled offload 0.5 fast link  the same through inductor: its waits kept, each offload ending its segment

Per configuration: torch.cuda.max_memory_allocated above what was live before the step against plan.peak_bytes,
the median step time, the loss (every configuration computes the same one: its spread is printed), and the same
step planned from a meta trace for this GPU (`autosp.plan(..., device=<--gpu>)`, as `autosp plan` plans on a machine
without one: ATen's CPU attention backward in the trace, priced as the kernel this GPU runs) against the plan made
from the real tensors and against the measurement. A configuration that fails (out of memory, a refused budget) is a
row saying so; the others still run. The table is printed last.

Exit status: 0 when every configuration ran and measured at most 0.1 % above its plan (and the meta plan); 1 when
one failed; 3 when a measured peak broke the plan's promise (the rows are named).

    python bench/gpu_step.py --out DIR                    # on the GPU (bench/gpu_check.sh runs it)
    .venv/bin/python bench/gpu_step.py --device cpu --tiny  # the same code at toy sizes on CPU (tests run it)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

CONFIGS = [
    ("eager 1.0", dict(memory_budget=1.0)),
    ("eager 0.5", dict(memory_budget=0.5)),
    ("eager least", dict(memory_budget="least")),
    ("eager least untiled", dict(memory_budget="least", tiles={})),
    ("compiled 0.5", dict(memory_budget=0.5, compile=True)),
    ("compiled 1.0", dict(memory_budget=1.0, compile=True)),
    ("compiled least", dict(memory_budget="least", compile=True)),
    ("offload least", dict(memory_budget="least", host_bandwidth=5e10)),
    ("offload 0.5 fast link", dict(memory_budget=0.5, host_bandwidth=1e13)),
    ("compiled offload 0.5 fast link", dict(memory_budget=0.5, host_bandwidth=1e13, compile=True)),
]


def build(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM
    if args.tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=256)
    else:                                         # Llama 3.2 1B
        shape = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                     vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True)
    cfg = LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=max(args.seq, 4096),
                      attn_implementation="sdpa", **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)


def measure(step, device, steps: int):
    """(median seconds, peak bytes above the start, loss) over `steps` steps after the first."""
    times, peaks, loss = [], [], None
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss, grads = step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            peaks.append(torch.cuda.max_memory_allocated() - before)
        else:
            from autosp.memory import peak_bytes
            t0 = time.perf_counter()
            loss, grads = step()
            times.append(time.perf_counter() - t0)
            del grads
            peak, (loss, grads) = peak_bytes(step)
            peaks.append(peak)
        del grads
    return statistics.median(times), max(peaks), float(loss)


def main(argv=None):
    # planned afresh, not read from the plan cache: the first step is timed, planning included
    os.environ["AUTOSP_PLAN_CACHE"] = "off"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2, help="measured steps per configuration, after a compiling one")
    ap.add_argument("--configs", default=",".join(name for name, _ in CONFIGS),
                    help="comma-separated names, run in this order, from: " + ", ".join(name for name, _ in CONFIGS))
    ap.add_argument("--tiny", action="store_true", help="toy shapes (hidden 64, vocab 256): the script's own test")
    ap.add_argument("--out", default=None, help="folder for results.jsonl")
    ap.add_argument("--gpu", default="cuda", help="the GPU the meta plans are made for (autosp.remat.cost.GPUS, "
                    "or cuda: the default GPU model); 'none' skips them")
    ap.add_argument("--tolerance", type=float, default=1e-3, help="how far above its plan a measured peak may be")
    args = ap.parse_args(argv)
    if args.tiny and args.seq == 32768:
        args.seq = 256
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autosp
    from tests.models import llama_loss
    device = torch.device(args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("sp",))
    model = build(args, device)
    fn = llama_loss(model)
    params = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), generator=g).to(device)
    print(f"# {' '.join(sys.argv)}\n# Llama: {args.layers} layers, hidden {model.config.hidden_size}, "
          f"vocab {model.config.vocab_size}, {next(iter(params.values())).dtype}; seq {args.seq}; {device} "
          f"({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}); torch {torch.__version__}",
          flush=True)
    known = dict(CONFIGS)
    wanted = [name.strip() for name in args.configs.split(",")]
    unknown = [name for name in wanted if name not in known]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; known: {list(known)}")
    meta = None
    if args.gpu != "none":                                       # the same model on meta, as `autosp plan` traces it
        with torch.device("meta"):
            meta_model = build(args, torch.device("meta"))
        meta_model = meta_model.to(dtype=next(iter(params.values())).dtype)
        meta = (llama_loss(meta_model), {k: v.detach().requires_grad_(True) for k, v in meta_model.named_parameters()},
                torch.empty(ids.shape, dtype=ids.dtype, device="meta"))
    rows, meta_plans = [], {}
    for name in wanted:                                          # in the order asked for
        kw = known[name]
        row = {"config": name}
        try:
            t0 = time.perf_counter()
            vg = autosp.value_and_grad(fn, mesh, **kw)
            vg(params, ids, ids)                                 # plans, compiles, runs once
            row["first_s"] = time.perf_counter() - t0
            plan = vg.plan(params, ids, ids)
            row["plan_bytes"] = plan.peak_bytes
            row["offload_bytes"] = plan.offload_bytes
            row["seconds"], row["measured_bytes"], row["loss"] = measure(lambda: vg(params, ids, ids), device,
                                                                         args.steps)
            row["ratio"] = row["measured_bytes"] / row["plan_bytes"]
            if meta is not None:                                 # compiled runs the eager plan: planned once
                mfn, mparams, mids = meta
                kw_plan = {k: v for k, v in kw.items() if k != "compile"}
                key = repr(sorted(kw_plan.items()))
                if key not in meta_plans:
                    meta_plans[key] = autosp.plan(mfn, mesh, mparams, mids, mids, device=args.gpu,
                                                  **kw_plan).peak_bytes
                row["meta_plan_bytes"] = meta_plans[key]
        except Exception as exc:  # noqa: BLE001 - a row saying what failed; the other configurations still run
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            traceback.print_exc()
        finally:
            vg = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    losses = [r["loss"] for r in rows if "loss" in r]
    eager = next((r["seconds"] for r in rows if r["config"] == "eager 0.5" and "seconds" in r), None)
    print(f"\n| configuration | plan peak (GiB) | measured (GiB) | measured / plan | meta plan for {args.gpu} (GiB) "
          "| measured / meta plan | offloaded (GiB) | step (s) | vs eager 0.5 | first step (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    broken = []
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | failed: {r['error']} | | | | | | | | |")
            continue
        vs = f"{r['seconds'] / eager:.3f}" if eager else ""
        m = r.get("meta_plan_bytes")
        mr = r["measured_bytes"] / m if m else None
        print(f"| {r['config']} | {r['plan_bytes'] / 2**30:.3f} | {r['measured_bytes'] / 2**30:.3f} | "
              f"{r['ratio']:.4f} | {'' if m is None else f'{m / 2**30:.3f}'} | {'' if mr is None else f'{mr:.4f}'} | "
              f"{r['offload_bytes'] / 2**30:.3f} | {r['seconds']:.3f} | {vs} | {r['first_s']:.1f} |")
        if r["ratio"] > 1 + args.tolerance or (mr is not None and mr > 1 + args.tolerance):
            broken.append(r["config"])
    full = next((r["seconds"] for r in rows if r["config"] == "eager 1.0" and "seconds" in r), None)
    for r in rows:                  # the copies out and back against the time the step spent beyond no remat
        if full and r.get("offload_bytes") and "seconds" in r:
            print(f"{r['config']}: {2 * r['offload_bytes'] / 2**30:.2f} GiB copied out and back; the step "
                  f"{r['seconds'] - full:+.3f} s against eager 1.0 (nothing recomputed, nothing offloaded)")
    if losses:
        print(f"\nloss {losses[0]:.6f}; largest relative spread over the configurations "
              f"{(max(losses) - min(losses)) / abs(losses[0]):.2e}")
    dist.destroy_process_group()
    if broken:
        print(f"\nBROKEN PROMISE: measured above the plan by more than {100 * args.tolerance:g} %: {', '.join(broken)}")
        return 3
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
