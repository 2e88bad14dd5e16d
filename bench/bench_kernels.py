"""GPU checks and benchmarks of autosp's kernels (run by bench/gpu_check.sh).

    python bench/bench_kernels.py check           # correctness at real sizes vs float64 (bf16/fp16/fp32)
    python bench/bench_kernels.py table [--out F] # TFLOP/s fwd/bwd: autosp Triton vs SDPA FLASH and cuDNN
    python bench/bench_kernels.py a2a [--out F]   # Ulysses pack/unpack bandwidth vs a plain copy
    python bench/bench_kernels.py masked [--out F]  # masked_attention's kernel: packed documents vs causal
    python bench/bench_kernels.py all

The table: causal, d=128, bf16, MHA (32/32 heads) and GQA 4:1 (32/8), s = 2k..32k at
16k tokens per step (batch = 16384 // s). FLOPs follow FlashAttention's convention:
forward 4*b*h*s^2*d/2 for causal, backward 2.5x that. Times are triton.testing.do_bench
means (L2 flushed). SDPA backends are pinned with torch.nn.attention.sdpa_kernel; a backend
that refuses GQA gets K/V expanded to MHA outside the timed region (marked *).
`check` holds each case to autosp.kernels.reference's bounds against float64: the relative norm
within TOL[dtype], and the worst element within 2x SDPA's own on the same inputs (max_err_bounds).
`check` also holds masked_attention's Triton path (packed documents, with and without padding) to the same
bounds against its float64 blockwise path, SDPA with the dense mask giving the worst-element bound.
`masked`: forward and backward ms of packed documents (the mask (k <= q) & (doc[q] == doc[k]), random
document lengths) against plain causal flash attention at the same total length, bf16, d=128, 32/8
heads, with the fraction of causal's tiles the documents leave (flash.visited_tiles) and the ideal
sum(doc_len^2) / s^2; "one document" runs the same terms kernel with a single document (its cost
over the plain kernel).
Without a GPU, `check`, `a2a` and `masked` run small shapes through the Triton interpreter (smoke test).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autosp.kernels import flash, ulysses_pack, ulysses_pack_out, ulysses_unpack, ulysses_unpack_out  # noqa: E402
from autosp.kernels.flash import flash_attention_with_lse  # noqa: E402
from autosp.kernels.maskfn import dense_mask  # noqa: E402
from autosp.kernels.maskterms import TileMask, recognise  # noqa: E402
from autosp.kernels.reference import (FLOOR, SDPA_FACTOR, TOL, attention_f64, max_err, max_err_bounds,  # noqa: E402
                                      rel_norm as rel)
from bench.autotune import attention_inputs, bench_graph_ms, bench_ms  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")


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
    print(f"{'case':44s} {'out':>8s} {'lse':>8s} {'dq':>8s} {'dk':>8s} {'dv':>8s}  tol    "
          f"worst element / bound (out dq dk dv)")
    for b, hq, hkv, s, d, causal, dt, model_layout in check_cases():
        q, k, v, do = attention_inputs(b, hq, hkv, s, d, dt, DEV, seed=s + d)
        if model_layout:
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        t0 = time.time()
        out, lse = flash_attention_with_lse(*leaves, causal, None, "triton")
        torch.autograd.backward(out, do)
        scale = 1 / math.sqrt(d)
        ref, ref_lse, *grads = attention_f64(q, k, v, causal, scale, do=do)
        errs = [rel(out, ref), rel(lse, ref_lse)] + [rel(t.grad, g) for t, g in zip(leaves, grads)]
        bound = max_err_bounds(q, k, v, do, causal, scale, (ref, *grads))
        worst = [max_err(out, ref)] + [max_err(t.grad, g) for t, g in zip(leaves, grads)]
        ratios = [w / bound[n] for w, n in zip(worst, ("out", "q", "k", "v"))]
        good = all(e <= TOL[dt] for e in errs) and all(r <= 1 for r in ratios)
        ok &= good
        name = (f"b{b} h{hq}/{hkv} s{s} d{d} {'causal' if causal else 'full'} {str(dt)[6:]}"
                f"{' [b,s,h,d]' if model_layout else ''}")
        print(f"{name:44s} " + " ".join(f"{e:8.1e}" for e in errs) + f"  {TOL[dt]:.0e}  "
              + " ".join(f"{r:4.2f}" for r in ratios) + f"  {'ok' if good else 'FAIL'} ({time.time() - t0:.1f}s)",
              flush=True)
        del leaves, out, lse, ref, grads
        if CUDA:
            torch.cuda.empty_cache()
    return ok


DOCS = "((k <= q) & (x0[q] == x1[k]))"


def packed_ids(s: int, mean: int, seed: int = 0) -> torch.Tensor:
    """[1, s] document ids, lengths uniform in [1, 2 * mean) (length-1 documents included)."""
    g = torch.Generator().manual_seed(seed)
    sizes = []
    while sum(sizes) < s:
        sizes.append(int(torch.randint(1, 2 * mean, (), generator=g)))
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))[:s][None]


def _masked_op(mask, leaves, valid_len, backend):
    from autosp.kernels.masked import _differentiable_op
    return lambda q, k, v: _differentiable_op(q, k, v, leaves, mask, None, valid_len, backend)


def check_masked() -> bool:
    """masked_attention's Triton path against its blockwise path in float64 (module docstring)."""
    bf, fp = torch.bfloat16, torch.float16
    b, hq, hkv, s, d = (1, 16, 4, 4095, 128) if CUDA else (1, 2, 1, 100, 32)
    ids = packed_ids(s, s // 8 if CUDA else 24).to(DEV)
    # one compiled variant on a GPU (the mask's form, dtype and head dim), the one `masked` times too
    docs = [ids[:, :, None], ids[:, None, :]]
    cases = [("packed documents", DOCS, docs, s, bf if CUDA else fp),
             ("packed documents + padding", DOCS, docs, s - s // 16, bf if CUDA else fp)]
    ok = True
    for name, mask, leaves, valid_len, dt in cases:
        q, k, v, do = attention_inputs(b, hq, hkv, s, d, dt, DEV, seed=s)
        t0 = time.time()
        got = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = _masked_op(mask, leaves, valid_len, "triton")(*got)
        torch.autograd.backward(out, do)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref, ref_lse = _masked_op(mask, leaves, valid_len, "torch")(*ref_in)
        torch.autograd.backward(ref, do.double())
        keep = dense_mask(mask, leaves, s) & (torch.arange(s, device=DEV) < valid_len)
        sdpa_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        sdpa = F.scaled_dot_product_attention(*sdpa_in, attn_mask=keep[:, None], enable_gqa=True)
        sdpa.backward(do)
        finite = ref_lse.isfinite()
        errs = [rel(out, ref), rel(lse[finite], ref_lse[finite])] + [rel(a.grad, r.grad) for a, r in zip(got, ref_in)]
        worst = [max_err(out, ref)] + [max_err(a.grad, r.grad) for a, r in zip(got, ref_in)]
        bound = [max(SDPA_FACTOR * max_err(x, r), FLOOR[dt])
                 for x, r in zip([sdpa] + [a.grad for a in sdpa_in], [ref] + [r.grad for r in ref_in])]
        good = all(e <= TOL[dt] for e in errs) and all(w <= bnd for w, bnd in zip(worst, bound))
        ok &= good
        print(f"{'masked ' + name + ' ' + str(dt)[6:]:44s} " + " ".join(f"{e:8.1e}" for e in errs)
              + f"  {TOL[dt]:.0e}  " + " ".join(f"{w / bnd:4.2f}" for w, bnd in zip(worst, bound))
              + f"  {'ok' if good else 'FAIL'} ({time.time() - t0:.1f}s)", flush=True)
        del got, out, lse, ref_in, ref, sdpa_in, sdpa
        if CUDA:
            torch.cuda.empty_cache()
    return ok


def masked_table(out_path: Path | None, rep_ms: int) -> str:
    """Packed documents against plain causal at the same total length (module docstring)."""
    seqs, mean = ([8192, 32768], 2048) if CUDA else ([128], 24)
    hq, hkv, d, dt = (32, 8, 128, torch.bfloat16) if CUDA else (2, 1, 32, torch.float16)
    lines = [f"masked_attention (Triton terms kernel) vs plain causal flash attention, {str(dt)[6:]}, d={d}, "
             f"heads {hq}/{hkv}, b=1, documents of random length (mean {mean}), "
             f"{torch.cuda.get_device_name() if CUDA else 'cpu (interpreter smoke test)'}", "",
             "| s | docs | sum(len^2)/s^2 | tiles vs causal | causal fwd ms | bwd ms | one document fwd | bwd "
             "| packed fwd ms | bwd ms | packed speed-up fwd | bwd |", "|" + "---|" * 12]
    for s in seqs:
        q, k, v, do = attention_inputs(1, hq, hkv, s, d, dt, DEV, seed=s)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        ids = packed_ids(s, mean, seed=s).to(DEV)
        lengths = torch.bincount(ids[0]).double()
        one = torch.zeros_like(ids)
        bm, bn = 128, 64
        tiles = TileMask.build(recognise(DOCS), [ids[:, :, None], ids[:, None, :]], s, s, DEV)
        causal_tiles = sum(-(-min((i + 1) * bm, s) // bn) for i in range(-(-s // bm)))
        frac = int(flash.visited_tiles(tiles, bm, bn).sum()) / causal_tiles
        res = {}
        for name, fn in (("causal", lambda *t: flash_attention_with_lse(*t, True, None, "triton")),
                         ("one", _masked_op(DOCS, [one[:, :, None], one[:, None, :]], s, "triton")),
                         ("packed", _masked_op(DOCS, [ids[:, :, None], ids[:, None, :]], s, "triton"))):
            try:
                res[name] = time_impl(lambda fn=fn: fn(*leaves), leaves, do, rep_ms)
            except Exception as e:
                print(f"{name} failed at s={s}: {type(e).__name__}: {e}", flush=True)
        cell = {n: (f"{res[n][0]:.2f}", f"{res[n][1]:.2f}") if n in res else ("n/a", "n/a") for n in ("causal", "one",
                                                                                                      "packed")}
        speed = [f"{res['causal'][i] / res['packed'][i]:.1f}x" if {"causal", "packed"} <= set(res) else "n/a"
                 for i in (0, 1)]
        lines.append(f"| {s} | {len(lengths)} | {float((lengths ** 2).sum()) / s ** 2:.3f} | {frac:.3f} | "
                     f"{' | '.join(cell['causal'])} | {' | '.join(cell['one'])} | {' | '.join(cell['packed'])} | "
                     f"{speed[0]} | {speed[1]} |")
        print(lines[-1], flush=True)
        leaves.clear()
        del q, k, v, do
        if CUDA:
            torch.cuda.empty_cache()
    lines += ["", "tiles vs causal: key tiles the packed mask leaves to compute (forward tiling 128 x 64) over "
              "plain causal's; one document: the terms kernel with a single document (its cost over the plain "
              "kernel)."]
    text = "\n".join(lines)
    if out_path:
        out_path.write_text(text + "\n")
    return text


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
    seqs = [4096, 16384, 65536] if CUDA else [128]      # issue 10's lengths
    d, dt, tokens = (128, torch.bfloat16, 16384) if CUDA else (32, torch.float16, 128)
    heads = [(32, 8), (32, 32)] if CUDA else [(2, 1), (2, 2)]     # GQA 32/8 first: the target's shape
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
    if CUDA:
        _save_speedups(rows, d, dt)
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


def _save_speedups(rows, d: int, dt: torch.dtype) -> None:
    """Write each shape's speedup of autosp's kernels over the best SDPA backend (forward + backward
    time) into the kernel config cache as "flash_vs_sdpa" entries: the sharding pass uses autosp's
    kernel in the per-rank program only where this is above 1 (kernels.config.measured_speedup).
    GQA rows win over MHA rows at the same length: the sharded program calls attention with GQA."""
    from autosp.kernels import config
    from bench.autotune import save_entries
    entries = {}
    for hq, hkv, s, b, flops, res in sorted(rows, key=lambda r: r[1] != r[0]):
        base = [sum(res[n]) for n in res if n != "autosp"]
        if "autosp" in res and base:
            key = config.cache_key("flash_vs_sdpa", torch.cuda.get_device_name(), dt, d, True, s)
            entries[key] = {"speedup": round(min(base) / sum(res["autosp"]), 3), "heads": f"{hq}/{hkv}"}
    if entries:
        print(f"wrote {len(entries)} flash_vs_sdpa entries to {save_entries(entries, config.cache_path())}")


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
    p.add_argument("what", choices=["check", "table", "a2a", "masked", "all"])
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    p.add_argument("--rep-ms", type=int, default=100 if CUDA else 1)
    a = p.parse_args(argv)
    print(f"device: {torch.cuda.get_device_name() if CUDA else 'cpu'}; torch {torch.__version__}; "
          f"triton {_triton_version()}", flush=True)
    ok = True
    if a.what in ("check", "all"):
        ok &= check_attention()
        ok &= check_masked()
        ok &= check_a2a()
        print("CHECK", "PASSED" if ok else "FAILED", flush=True)
    if a.what in ("a2a", "all"):
        print(a2a_bench(a.out if a.what == "a2a" else None, a.rep_ms), flush=True)
    if a.what in ("table", "all"):
        print(table(a.out if a.what == "table" else None, a.rep_ms), flush=True)
    if a.what in ("masked", "all"):
        print(masked_table(a.out if a.what == "masked" else None, a.rep_ms), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
