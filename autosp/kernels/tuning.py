"""Autotuning of the Triton kernels' launch configs: search spaces, timing, the search itself.

`bench/autotune_attention.py` and `bench/autotune_a2a.py` are thin command lines
over this module; the winners go to the JSON cache that `config.lookup` reads
at run time. Every candidate is checked against the default config's result
before it may win, so a config that compiles to wrong code never lands in the
cache. Candidates that do not fit (shared memory, registers) are skipped.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Callable

import torch

from autosp.kernels import config

# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2) of the backward: the stationary block is
# the larger one in both programs (config.is_valid).
_BWD_TILES = [(32, 128, 128, 32), (16, 64, 64, 16), (32, 64, 64, 32), (64, 128, 128, 64), (16, 128, 128, 16),
              (64, 64, 64, 64)]


def bench_ms(fn: Callable[[], object], rep_ms: int = 50, cuda: bool = True) -> float:
    """Mean milliseconds of fn(): triton.testing.do_bench on CUDA (L2 flushed between
    runs), a wall-clock loop elsewhere (the CPU interpreter smoke-tests the scripts)."""
    if cuda and torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms))
    fn()
    n, t0 = 0, time.perf_counter()
    while n < 3 and (time.perf_counter() - t0) * 1e3 < rep_ms:
        fn()
        n += 1
    return (time.perf_counter() - t0) * 1e3 / max(n, 1)


def bench_graph_ms(fn: Callable[[], object], rep_ms: int = 50) -> float:
    """GPU time of fn() replayed from a CUDA graph: the kernels alone, without the Python
    launch overhead that dominates small copies (falls back to bench_ms if capture fails)."""
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms))
    except Exception:  # capture is not possible for every callable; eager timing still is
        return bench_ms(fn, rep_ms, True)


def fwd_candidates(head_dim: int, dtype: torch.dtype, quick: bool) -> list[dict]:
    if quick:
        tiles = [(128, 64), (128, 128), (64, 64), (128, 32)] if head_dim <= 128 else [(64, 32), (64, 64)]
        warps_stages = [(8, 3), (4, 3)] if head_dim <= 128 else [(4, 2), (8, 2)]
    else:
        tiles = [(m, n) for m in (64, 128) for n in (32, 64, 128) if m % n == 0]
        warps_stages = list(itertools.product((4, 8), (2, 3, 4)))
    out = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for (m, n), (w, s) in
           itertools.product(tiles, warps_stages)]
    if dtype == torch.float32 or head_dim > 128:  # fp32 / wide tiles run out of shared memory
        out = [c for c in out if c["BLOCK_M"] * c["BLOCK_N"] <= 64 * 64]
    return out


def bwd_candidates(head_dim: int, dtype: torch.dtype, quick: bool) -> list[dict]:
    tiles = _BWD_TILES[:3] if quick else _BWD_TILES
    warps_stages = [(4, 3), (8, 2)] if quick else list(itertools.product((4, 8), (1, 2, 3, 4)))
    out = [dict(BLOCK_M1=a, BLOCK_N1=b, BLOCK_M2=c, BLOCK_N2=d, num_warps=w, num_stages=s)
           for (a, b, c, d), (w, s) in itertools.product(tiles, warps_stages)]
    if dtype == torch.float32 or head_dim > 128:
        out = [c for c in out if c["BLOCK_N1"] <= 64]
    return out


def copy_candidates(quick: bool) -> list[dict]:
    rows = (16, 32, 64) if quick else (8, 16, 32, 64, 128)
    warps = (4, 8) if quick else (1, 2, 4, 8)
    return [dict(BLOCK_R=r, num_warps=w) for r, w in itertools.product(rows, warps)]


def search(kernel: str, run: Callable[[dict], object], candidates: list[dict], check: Callable[[dict], float],
           tol: float, rep_ms: int, log: Callable[[str], None] = print,
           cuda: bool = True) -> tuple[dict | None, float, list]:
    """Time run(cfg) for each candidate that passes first: check(cfg) (its error against the
    reference) must be within `tol`."""
    results, best, best_ms = [], None, math.inf
    for cfg in candidates:
        if not config.is_valid(kernel, cfg):
            continue
        try:
            err = check(cfg)
            if not err <= tol:
                log(f"  {kernel} {cfg}: WRONG (err {err:.2e}), skipped")
                results.append((cfg, None, err))
                continue
            ms = bench_ms(lambda: run(cfg), rep_ms, cuda)
        except Exception as e:  # out of resources, compile failure: not a candidate here
            log(f"  {kernel} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
            results.append((cfg, None, None))
            continue
        log(f"  {kernel} {cfg}: {ms:.3f} ms (err {err:.1e})")
        results.append((cfg, ms, err))
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms, results


def attention_inputs(b: int, hq: int, hkv: int, s: int, d: int, dtype: torch.dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g, device=device).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g, device=device).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=g, device=device).to(dtype)
    do = torch.randn(b, hq, s, d, generator=g, device=device).to(dtype)
    return q, k, v, do


def tune_attention(b: int, hq: int, hkv: int, s: int, d: int, dtype: torch.dtype, causal: bool, device,
                   which=("fwd", "bwd"), quick: bool = True, rep_ms: int = 50,
                   log: Callable[[str], None] = print) -> dict[str, dict]:
    """Best flash_fwd / flash_bwd configs for one shape, as cache entries {key: cfg + timing}."""
    from autosp.kernels._triton import device_name
    from autosp.kernels.flash_bwd import attention_backward
    from autosp.kernels.flash_fwd import attention_forward
    from autosp.kernels.reference import attention_f64, max_err

    device = torch.device(device)
    q, k, v, do = attention_inputs(b, hq, hkv, s, d, dtype, device)
    scale = 1.0 / math.sqrt(d)
    # Correctness first, against float64 (never against another config): at a length that keeps
    # the float64 reference small and still has full tiles, a ragged tail and the causal diagonal.
    s_check = min(s, 1024 + 37)
    cq, ck, cv, cdo = attention_inputs(b, hq, hkv, s_check, d, dtype, device, seed=1)
    ref = attention_f64(cq, ck, cv, causal, scale, do=cdo)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3}.get(dtype, 2e-2)

    def check_fwd(c):
        o, lse = attention_forward(cq, ck, cv, causal, scale, c)
        return max(max_err(o, ref[0]), max_err(lse, ref[1]))

    def check_bwd(c):
        o, lse = attention_forward(cq, ck, cv, causal, scale, config.default_config("flash_fwd", device, dtype, d))
        grads = attention_backward(cdo, cq, ck, cv, o, lse, None, causal, scale, c)
        return max(max_err(g, r) for g, r in zip(grads, ref[2:]))

    flops = 4 * b * hq * d * (s * (s + 1) // 2 if causal else s * s)
    entries = {}
    if "fwd" in which:
        best, ms, _ = search("flash_fwd", lambda c: attention_forward(q, k, v, causal, scale, c),
                             fwd_candidates(d, dtype, quick), check_fwd, tol, rep_ms, log, device.type == "cuda")
        if best is not None:
            key = config.cache_key("flash_fwd", device_name(device), dtype, d, causal, s)
            entries[key] = {**best, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
            log(f"best {key}: {entries[key]}")
    if "bwd" in which:
        o, lse = attention_forward(q, k, v, causal, scale, config.default_config("flash_fwd", device, dtype, d))
        best, ms, _ = search("flash_bwd", lambda c: attention_backward(do, q, k, v, o, lse, None, causal, scale, c),
                             bwd_candidates(d, dtype, quick), check_bwd, tol, rep_ms, log, device.type == "cuda")
        if best is not None:
            key = config.cache_key("flash_bwd", device_name(device), dtype, d, causal, s)
            entries[key] = {**best, "ms": round(ms, 4), "tflops": round(2.5 * flops / ms / 1e9, 1)}
            log(f"best {key}: {entries[key]}")
    return entries


def tune_copy(b: int, heads: list[int], s_loc: int, d: int, world: int, dtype: torch.dtype, device,
              quick: bool = True, rep_ms: int = 50, log: Callable[[str], None] = print) -> dict[str, dict]:
    """Best layout_copy config for the Ulysses pack of one shape (QKV: [b, s_loc, h, d] views)."""
    from autosp.kernels._triton import device_name
    from autosp.kernels.a2a_ops import _pack_heads

    device = torch.device(device)
    xs = [torch.randn(b, s_loc, h, d, device=device).to(dtype).transpose(1, 2) for h in heads]
    reference = _pack_heads(xs, world, "torch")

    def run(cfg):
        with config.override("layout_copy", **cfg):
            return _pack_heads(xs, world, "triton")

    def check(cfg):                 # a copy: exactly the torch path's bytes
        return 0.0 if torch.equal(run(cfg), reference) else math.inf

    best, ms, _ = search("layout_copy", run, copy_candidates(quick), check, 0.0, rep_ms, log,
                         device.type == "cuda")
    if best is None:
        return {}
    nbytes = 2 * reference.numel() * reference.element_size()
    key = config.cache_key("layout_copy", device_name(device), dtype, d, False, s_loc)
    entry = {**best, "ms": round(ms, 4), "GBps": round(nbytes / ms / 1e6, 1)}
    log(f"best {key}: {entry}")
    return {key: entry}
