"""GPU checks and benchmarks of autosp's kernels (run by bench/gpu_check.sh).

    python bench/bench_kernels.py check           # correctness at real sizes vs float64 (bf16/fp16/fp32)
    python bench/bench_kernels.py table [--out F] # TFLOP/s fwd/bwd: autosp Triton vs SDPA FLASH and cuDNN
    python bench/bench_kernels.py a2a [--out F]   # Ulysses pack/unpack bandwidth vs a plain copy
    python bench/bench_kernels.py all

The table: causal, d=128, bf16, MHA (32/32 heads) and GQA 4:1 (32/8), s = 2k..32k at
16k tokens per step (batch = 16384 // s). FLOPs follow FlashAttention's convention:
forward 4*b*h*s^2*d/2 for causal, backward 2.5x that. Times are triton.testing.do_bench
means (L2 flushed). SDPA backends are pinned with torch.nn.attention.sdpa_kernel; a backend
that refuses GQA gets K/V expanded to MHA outside the timed region (marked *).
Without a GPU, `check` and `a2a` run small shapes through the Triton interpreter (smoke test).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from autosp.kernels import ulysses_pack, ulysses_pack_out, ulysses_unpack, ulysses_unpack_out
from autosp.kernels.flash_torch import math_backward, math_forward
from autosp.kernels.tuning import attention_inputs, bench_graph_ms, bench_ms

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    n = b.norm()
    return ((a - b).norm() / (n if n > 0 else 1)).item()


# ---------------------------------------------------------------- check


def check_cases():
    bf, fp, f32 = torch.bfloat16, torch.float16, torch.float32
    if not CUDA:  # interpreter smoke test
        return [(1, 4, 2, 100, 64, True, fp, False), (1, 2, 2, 33, 32, False, f32, True)]
    # (b, hq, hkv, s, d, causal, dtype, [b, s, h, d] storage seen through a transpose)
    return [
        (2, 16, 16, 4096, 128, True, bf, False),
        (1, 32, 8, 8192, 128, True, bf, True),     # Llama-8B-like GQA 4:1, model layout
        (2, 16, 4, 2047, 128, False, bf, False),   # ragged, non-causal
        (4, 8, 8, 1000, 64, True, fp, False),
        (1, 8, 2, 3000, 256, True, bf, False),
        (2, 8, 8, 777, 80, True, bf, True),        # head dim padded to 128
        (1, 4, 4, 1024, 64, True, f32, False),     # IEEE fp32 dots
        (3, 6, 2, 1, 32, True, bf, False),
        (3, 6, 2, 65, 32, False, fp, False),
    ]


def check_attention() -> bool:
    ok = True
    print(f"{'case':44s} {'out':>8s} {'lse':>8s} {'dq':>8s} {'dk':>8s} {'dv':>8s} {'sdpa out':>9s}  tol")
    for b, hq, hkv, s, d, causal, dt, model_layout in check_cases():
        q, k, v, do = attention_inputs(b, hq, hkv, s, d, dt, DEV, seed=s + d)
        if model_layout:
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        t0 = time.time()
        out, lse = torch.ops.autosp.flash_attention(*leaves, causal, None, "triton")
        torch.autograd.backward(out, do)
        scale = 1 / math.sqrt(d)
        q64, k64, v64 = (t.double() for t in (q, k, v))
        ref, ref_lse = math_forward(q64, k64, v64, causal, scale)
        grads = math_backward(do.double(), q64, k64, v64, ref, ref_lse, None, causal, scale)
        errs = [rel(out, ref), rel(lse, ref_lse)] + [rel(t.grad, g) for t, g in zip(leaves, grads)]
        try:
            sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)
            sdpa_err = f"{rel(sdpa, ref):9.1e}"
        except RuntimeError:
            sdpa_err = f"{'n/a':>9s}"
        good = all(e <= TOL[dt] for e in errs)
        ok &= good
        name = (f"b{b} h{hq}/{hkv} s{s} d{d} {'causal' if causal else 'full'} {str(dt)[6:]}"
                f"{' [b,s,h,d]' if model_layout else ''}")
        print(f"{name:44s} " + " ".join(f"{e:8.1e}" for e in errs) + f" {sdpa_err}  {TOL[dt]:.0e} "
              f"{'ok' if good else 'FAIL'} ({time.time() - t0:.1f}s)", flush=True)
        del leaves, out, lse, ref, grads
    return ok


def check_a2a() -> bool:
    world, b, s_loc, d = (8, 2, 1000, 128) if CUDA else (2, 1, 16, 32)
    dt = torch.bfloat16 if CUDA else torch.float16
    heads = [32, 8, 8] if CUDA else [4, 2, 2]
    xs = [torch.randn(b, s_loc, h, d, device=DEV).to(dt).transpose(1, 2) for h in heads]
    ok = True
    for name, fn in [
        ("pack", lambda be: [ulysses_pack(xs, world, backend=be)]),
        ("unpack", lambda be: ulysses_unpack(ulysses_pack(xs, world, backend="torch"), heads, b, s_loc, d, world,
                                             backend=be)),
        ("pack_out", lambda be: [ulysses_pack_out(xs[0], world, backend=be)]),
        ("unpack_out", lambda be: [ulysses_unpack_out(ulysses_pack(xs, world, backend="torch")[:xs[0].numel()],
                                                      b, heads[0] // world, s_loc, d, world, backend=be)]),
    ]:
        same = all(torch.equal(a, c) for a, c in zip(fn("triton"), fn("torch")))
        ok &= same
        print(f"a2a {name:10s} triton == torch: {same}")
    return ok


# ---------------------------------------------------------------- table


def sdpa_backends():
    from torch.nn.attention import SDPBackend

    return [("FLASH", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION)]


def _sdpa_fn(backend, q, k, v, gqa: bool):
    from torch.nn.attention import sdpa_kernel

    def run():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return run


def time_impl(fwd, leaves, do, rep_ms):
    """(forward ms, backward ms) of fwd() over `leaves`."""
    with torch.no_grad():
        f_ms = bench_ms(fwd, rep_ms, CUDA)
    out = fwd()
    out = out[0] if isinstance(out, tuple) else out
    b_ms = bench_ms(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True), rep_ms, CUDA)
    return f_ms, b_ms


def table(out_path: Path | None, rep_ms: int) -> str:
    seqs = [2048, 4096, 8192, 16384, 32768] if CUDA else [128]
    d, dt, tokens = (128, torch.bfloat16, 16384) if CUDA else (32, torch.float16, 128)
    heads = [(32, 32), (32, 8)] if CUDA else [(2, 2), (2, 1)]
    rows = []
    for hq, hkv in heads:
        for s in seqs:
            b = max(1, tokens // s)
            q, k, v, do = attention_inputs(b, hq, hkv, s, d, dt, DEV, seed=s)
            leaves = [t.requires_grad_() for t in (q, k, v)]
            flops = 4 * b * hq * s * s * d / 2
            res = {}
            try:
                res["autosp"] = time_impl(lambda ls=leaves: torch.ops.autosp.flash_attention(*ls, True, None, "triton"),
                                          leaves, do, rep_ms)
            except Exception as e:
                print(f"autosp failed at s={s}: {type(e).__name__}: {e}", flush=True)
            for name, backend in sdpa_backends() if CUDA else []:
                for expand in (False, True):
                    try:
                        if expand and hkv != hq:
                            g = hq // hkv
                            ek, ev = (t.detach().repeat_interleave(g, 1).requires_grad_() for t in (k, v))
                            args = (q, ek, ev)
                        elif expand:
                            break
                        else:
                            args = (q, k, v)
                        res[name + ("*" if expand else "")] = time_impl(
                            _sdpa_fn(backend, *args, gqa=hkv != hq and not expand), list(args), do, rep_ms)
                        break
                    except RuntimeError as e:
                        print(f"{name} s={s} h={hq}/{hkv}{' expanded' if expand else ''}: "
                              f"{str(e).splitlines()[0][:150]}", flush=True)
            rows.append((hq, hkv, s, b, flops, res))
            print(f"h{hq}/{hkv} s={s} b={b}: " + ", ".join(f"{n} fwd {f:.2f} ms bwd {bw:.2f} ms"
                                                           for n, (f, bw) in res.items()), flush=True)
            del q, k, v, do, leaves
            if CUDA:
                torch.cuda.empty_cache()
    names = ["autosp", "FLASH", "cuDNN"]
    dev = torch.cuda.get_device_name() if CUDA else "cpu (interpreter smoke test)"
    lines = [f"TFLOP/s, causal, d={d}, {str(dt)[6:]}, {tokens} tokens/step, {dev}, "
             f"torch {torch.__version__}, triton {_triton_version()}", "",
             "| heads q/kv | s | b | " + " | ".join(f"fwd {n}" for n in names) + " | "
             + " | ".join(f"bwd {n}" for n in names) + " | autosp speed vs FLASH fwd | bwd |",
             "|" + "---|" * (3 + 2 * len(names) + 2)]
    for hq, hkv, s, b, flops, res in rows:
        def cell(n, i, mult):
            key = n if n in res else n + "*"
            if key not in res:
                return "n/a"
            return f"{mult * flops / res[key][i] / 1e9:.0f}" + ("*" if key != n else "")

        def ratio(i):
            base = res.get("FLASH") or res.get("FLASH*")
            return f"{base[i] / res['autosp'][i]:.2f}x" if base and "autosp" in res else "n/a"

        lines.append(f"| {hq}/{hkv} | {s} | {b} | " + " | ".join(cell(n, 0, 1) for n in names) + " | "
                     + " | ".join(cell(n, 1, 2.5) for n in names) + f" | {ratio(0)} | {ratio(1)} |")
    lines.append("")
    lines.append("* K/V expanded to MHA before the call (the backend refused enable_gqa).")
    text = "\n".join(lines)
    if out_path:
        out_path.write_text(text + "\n")
    return text


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:
        return "none"


# ---------------------------------------------------------------- a2a bandwidth


def a2a_bench(out_path: Path | None, rep_ms: int) -> str:
    world, b, s_loc, d = (8, 1, 8192, 128) if CUDA else (2, 1, 16, 32)
    heads = [32, 8, 8] if CUDA else [4, 2, 2]
    dt = torch.bfloat16 if CUDA else torch.float16
    xs = [torch.randn(b, s_loc, h, d, device=DEV).to(dt).transpose(1, 2) for h in heads]  # model layout
    n = sum(x.numel() for x in xs)
    nbytes = 2 * n * xs[0].element_size()  # read + write
    send = ulysses_pack(xs, world, backend="torch")
    o = torch.randn(b, heads[0] // world, world * s_loc, d, device=DEV).to(dt)
    o_send = ulysses_pack_out(o, world, backend="torch")
    src, dst = torch.empty(n, device=DEV, dtype=dt), torch.empty(n, device=DEV, dtype=dt)
    src_o, dst_o = torch.empty(o.numel(), device=DEV, dtype=dt), torch.empty(o.numel(), device=DEV, dtype=dt)

    def naive_pack():  # what hand-written Ulysses does: permute().contiguous() per tensor, then cat
        return torch.cat([x.reshape(b, world, x.shape[1] // world, s_loc, d).transpose(0, 1).contiguous().flatten()
                          for x in xs])

    def naive_unpack():
        outs, off = [], 0
        for h in heads:
            m = b * h * s_loc * d // world
            chunk = send.view(world, -1)[:, off:off + m].reshape(world, b, h // world, s_loc, d)
            outs.append(chunk.permute(1, 2, 0, 3, 4).contiguous().view(b, h // world, world * s_loc, d))
            off += m
        return outs

    cases = [
        ("plain copy (QKV bytes)", lambda: dst.copy_(src), nbytes),
        ("pack triton", lambda: ulysses_pack(xs, world, backend="triton"), nbytes),
        ("pack torch copy_", lambda: ulysses_pack(xs, world, backend="torch"), nbytes),
        ("pack permute+cat (naive)", naive_pack, nbytes),
        ("unpack triton", lambda: ulysses_unpack(send, heads, b, s_loc, d, world, backend="triton"), nbytes),
        ("unpack torch copy_", lambda: ulysses_unpack(send, heads, b, s_loc, d, world, backend="torch"), nbytes),
        ("unpack permute (naive)", naive_unpack, nbytes),
        ("plain copy (O bytes)", lambda: dst_o.copy_(src_o), 2 * o.numel() * o.element_size()),
        ("pack_out triton", lambda: ulysses_pack_out(o, world, backend="triton"), 2 * o.numel() * o.element_size()),
        ("pack_out torch copy_", lambda: ulysses_pack_out(o, world, backend="torch"),
         2 * o.numel() * o.element_size()),
        ("unpack_out triton", lambda: ulysses_unpack_out(o_send, b, heads[0] // world, s_loc, d, world,
                                                         backend="triton"), 2 * o.numel() * o.element_size()),
        ("unpack_out torch copy_", lambda: ulysses_unpack_out(o_send, b, heads[0] // world, s_loc, d, world,
                                                              backend="torch"), 2 * o.numel() * o.element_size()),
    ]
    lines = [f"Ulysses layout kernels, world={world}, b={b}, s/P={s_loc}, heads q/k/v={heads}, d={d}, "
             f"{str(dt)[6:]}; GB/s counts read + write of the GPU time (CUDA graph replay); "
             f"eager = the same call timed from Python, launch overhead included", "",
             "| kernel | GPU ms | GB/s | vs plain copy | eager ms |", "|---|---|---|---|---|"]
    base = None
    for name, fn, nb in cases:
        try:
            eager = bench_ms(fn, rep_ms, CUDA)
            ms = bench_graph_ms(fn, rep_ms) if CUDA else eager
        except Exception as e:
            lines.append(f"| {name} | failed: {type(e).__name__}: {str(e)[:80]} | | | |")
            continue
        gbps = nb / ms / 1e6
        if name.startswith("plain copy"):
            base = gbps
        lines.append(f"| {name} | {ms:.3f} | {gbps:.0f} | {gbps / base:.0%} | {eager:.3f} |")
    text = "\n".join(lines)
    if out_path:
        out_path.write_text(text + "\n")
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["check", "table", "a2a", "all"])
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    p.add_argument("--rep-ms", type=int, default=100 if CUDA else 1)
    a = p.parse_args(argv)
    print(f"device: {torch.cuda.get_device_name() if CUDA else 'cpu'}; torch {torch.__version__}; "
          f"triton {_triton_version()}", flush=True)
    ok = True
    if a.what in ("check", "all"):
        ok &= check_attention()
        ok &= check_a2a()
        print("CHECK", "PASSED" if ok else "FAILED", flush=True)
    if a.what in ("a2a", "all"):
        print(a2a_bench(a.out if a.what == "a2a" else None, a.rep_ms), flush=True)
    if a.what in ("table", "all"):
        print(table(a.out if a.what == "table" else None, a.rep_ms), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
