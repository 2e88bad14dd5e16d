"""Each GPU kernel's scratch, as the CUDA caching allocator counts it, against the memory model's (one GPU).

A kernel's workspace is what it allocates while it runs beyond its outputs: the allocator's peak during the op
minus what is allocated once it returns. The memory model (autosp/remat/liveness.py, WORKSPACE_CUDA_BY_TARGET)
counts it per aten overload; this script holds it to the allocator at real sizes:

  step   every op of one planned training step (bench/gpu_step.py's Llama, Llama 3.2 1B's shapes, bf16,
         memory_budget 'least' by default), the ops with the largest workspaces and every op the model names
  ops    SDPA's backends (FLASH, EFFICIENT, cuDNN) forward and backward, MHA and GQA, head dims 64 and 128, and
         embedding_dense_backward (distinct and repeated token ids), each alone
  heldout  the same at shapes the formulas were not fitted to: batch 2, head dim 96, lengths that are not multiples
         of 128, embedding ids not a multiple of anything; the formula's error for each (bench/gpu_check.sh)
  blas   cuBLAS's workspaces, made at a thread's first GEMM and kept: this thread, another, autograd's backward
         (first: a GEMM of another part would have made this thread's)

    python bench/cuda_workspace.py [--seq 32768] [--layers 4] [--parts blas,ops,heldout,step]

Prints one markdown table per part: op, shapes, measured workspace, the model's, their difference.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from autosp.remat.liveness import WORKSPACE_CUDA_BY_TARGET  # noqa: E402


class OpScratch(TorchDispatchMode):
    """Per op call: (overload, input shapes, allocator peak during the call minus what is allocated after it)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **kwargs)
        scratch = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        ins = [a for a in args if isinstance(a, torch.Tensor)]
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        model = WORKSPACE_CUDA_BY_TARGET[func](ins, outs) if func in WORKSPACE_CUDA_BY_TARGET else None
        self.rows.append((str(func), [tuple(t.shape) for t in ins[:3]], scratch, model))
        return out


def mib(n) -> str:
    return "" if n is None else f"{n / 2**20:.1f}"


def table(title: str, rows) -> str:
    lines = [title, "", "| op | inputs (first 3) | measured MiB | model MiB | model - measured MiB |",
             "|---|---|---|---|---|"]
    for name, shapes, got, model in rows:
        diff = "" if model is None else f"{(model - got) / 2**20:+.1f}"
        lines.append(f"| {name} | {' '.join('x'.join(map(str, s)) for s in shapes)} | {mib(got)} | {mib(model)} "
                     f"| {diff} |")
    return "\n".join(lines) + "\n"


def step_part(args) -> str:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autosp
    from bench.gpu_step import build
    from tests.models import llama_loss
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29573")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("sp",))
    ns = argparse.Namespace(tiny=False, layers=args.layers, seq=args.seq)
    model = build(ns, torch.device("cuda"))
    fn = llama_loss(model)
    params = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0)).cuda()
    budget = args.budget if args.budget == "least" else float(args.budget)
    vg = autosp.value_and_grad(fn, mesh, memory_budget=budget)
    vg(params, ids, ids)
    plan = vg.plan(params, ids, ids)
    mode = OpScratch()
    with mode:
        vg(params, ids, ids)
    worst = defaultdict(lambda: None)
    for row in mode.rows:                                   # per overload: its call with the largest scratch
        if worst[row[0]] is None or row[2] > worst[row[0]][2]:
            worst[row[0]] = row
    rows = sorted(worst.values(), key=lambda r: -r[2])
    shown = [r for r in rows if r[2] >= 2**20 or r[3] is not None]
    ops = sorted({r[0] for r in mode.rows if "attention" in r[0] or "embedding" in r[0]})
    return table(f"One step's ops (budget {args.budget}, plan peak {plan.peak_bytes / 2**30:.3f} GiB, seq {args.seq}, "
                 f"{args.layers} layers): every overload's largest scratch of 1 MiB or more, and those the model "
                 f"names; attention/embedding ops that ran: {', '.join(ops)}", shown)


def ops_part(args, b: int = 1, cases=((32, 8, 64, 32768), (32, 32, 64, 8192), (32, 8, 128, 16384),
                                       (32, 32, 128, 4096)), ids=(4096, 32768), title="Ops alone") -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        for hq, hk, d, s in cases:
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
            k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
            v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
            do = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
            mode = OpScratch()
            try:
                with sdpa_kernel(backend), mode:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hk != hq)
                    torch.autograd.grad(out, (q, k, v), do)
            except RuntimeError as exc:
                rows.append((f"{backend.name} h{hq}/{hk} d{d} s{s}: refused ({str(exc).splitlines()[0][:60]})",
                             [], 0, None))
                continue
            rows += [r for r in mode.rows if "attention" in r[0]]
            del q, k, v, do, out
    for n, distinct in [(n, True) for n in ids] + [(ids[-1], False)]:
        w = torch.zeros(128256, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ids = (torch.randperm(128256, device="cuda")[:n] if distinct
               else torch.zeros(n, dtype=torch.long, device="cuda"))
        x = F.embedding(ids[None], w)
        mode = OpScratch()
        with mode:
            torch.autograd.grad(x, w, torch.ones_like(x))
        kind = "distinct" if distinct else "one"
        rows += [(f"{r[0]} ({kind} ids)", *r[1:]) for r in mode.rows if "embedding" in r[0]]
        del w, x
    return table(f"{title} (bf16, causal, batch {b})", rows)


def heldout_part(args) -> str:
    """Shapes no formula was fitted to: batch 2, head dim 96, lengths off the 128 grid, GQA and not."""
    return ops_part(args, b=2, cases=((32, 8, 96, 12_345), (16, 16, 96, 5_000), (24, 8, 128, 9_999),
                                      (32, 8, 64, 20_000)), ids=(3_500, 25_001), title="Held-out shapes")


def blas_part(args) -> str:
    """cuBLAS's persistent workspaces: allocated through the caching allocator at a thread's first GEMM on a stream
    and kept (32 MiB a handle on Hopper by torch's default, CUBLAS_WORKSPACE_CONFIG otherwise), so they are in a
    run's measured peak and in no op's scratch. Each row: what memory_allocated grew by at that first GEMM (a leading
    hypothesis for `autosp train`'s +65.3 MiB on the H200 (bench/RESULTS.md): one workspace for the step's thread and
    one for autograd's device thread)."""
    import threading
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    rows = []

    def grew(what, fn, made=lambda out: out.numel() * out.element_size()):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        rows.append((what, [tuple(a.shape)], torch.cuda.memory_allocated() - before - made(out), None))
        return out

    keep = [grew("first GEMM, this thread", lambda: a @ a)]
    keep.append(grew("second GEMM, this thread", lambda: a @ a))
    found = []
    t = threading.Thread(target=lambda: found.append(grew("first GEMM, another thread", lambda: a @ a)))
    t.start()
    t.join()
    w = a.detach().clone().requires_grad_(True)
    y = grew("forward GEMM (requires grad)", lambda: w @ a)
    grew("its backward (autograd's device thread)", lambda: y.sum().backward(),
         made=lambda _: w.grad.numel() * w.grad.element_size())
    return table("cuBLAS workspaces (kept once made; model: none)", rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budget", default="least")
    ap.add_argument("--parts", default="blas,ops,heldout,step")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_workspace: no GPU visible (it measures the CUDA caching allocator)")
        return 2
    parts = {"ops": ops_part, "heldout": heldout_part, "step": step_part, "blas": blas_part}
    for name in args.parts.split(","):
        print(parts[name](args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
