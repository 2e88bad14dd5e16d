"""Autotune autosp's Triton kernels (flash attention forward and backward, the Ulysses layout copy)
and write the launch-config cache that `autosp.kernels.config` reads.

    python bench/autotune.py                                   # all kernels: bf16, d=128, GQA 32/8
    python bench/autotune.py --kernels fwd,bwd --seqs 4096,16384 --dtypes bf16,fp16 --head-dims 64,128
    python bench/autotune.py --kernels copy --s-locs 1024,4096 --world 4 --out cfg.json
    python bench/autotune.py --full                            # the whole search space (slow)

Entries are keyed (kernel, device name, dtype, head dim, causal, sequence bucket; the copy:
"full" and the bucket of s/P) and merged into --out (default: $AUTOSP_KERNEL_CONFIGS or
~/.cache/autosp/kernel_configs.json) as they are found, so a timeout keeps what was found.
Shapes without an entry use the nearest tuned bucket, then the defaults. A candidate is timed
only after it matches float64 within autosp.kernels.reference's bounds (attention: the worst
element within 2x SDPA's own on the same inputs; the copy: bit for bit), so a config that
compiles to wrong code never lands in the cache; candidates that do not fit (shared memory,
registers) are skipped. Without a GPU the search runs tiny shapes through the Triton
interpreter: a smoke test of this script, not a tuning, written to a temporary file unless
--out or $AUTOSP_KERNEL_CONFIGS names one. Exit status 1 if a kernel asked for found no config.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autosp.kernels import config  # noqa: E402
from autosp.kernels._triton import device_name  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2) of the backward: the stationary block is the larger
# one in both programs (config.is_valid).
_BWD_TILES = [(32, 64, 128, 32), (32, 128, 128, 32), (16, 64, 64, 16), (32, 64, 64, 32), (64, 128, 128, 64),
              (16, 128, 128, 16), (64, 64, 64, 64)]


# ---------------------------------------------------------------- timing


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


def attention_inputs(b: int, hq: int, hkv: int, s: int, d: int, dtype: torch.dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g, device=device).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g, device=device).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=g, device=device).to(dtype)
    do = torch.randn(b, hq, s, d, generator=g, device=device).to(dtype)
    return q, k, v, do


# ---------------------------------------------------------------- search spaces


def _tma_variants(configs: list[dict], quick: bool) -> list[dict]:
    """Each config with the device's default TMA setting (quick), or with both (the full search);
    off where the device has no tensor descriptors."""
    tma = config.default_config("flash_fwd", torch.device("cuda"), torch.float16, 128)["TMA"] \
        if torch.cuda.is_available() else 0
    modes = (tma,) if quick or not tma else (1, 0)
    return [dict(c, TMA=t) for c in configs for t in modes]


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
    return _tma_variants(out, quick)


def bwd_candidates(head_dim: int, dtype: torch.dtype, quick: bool) -> list[dict]:
    tiles = _BWD_TILES[:3] if quick else _BWD_TILES
    warps_stages = [(8, 3), (4, 3)] if quick else list(itertools.product((4, 8), (1, 2, 3, 4)))
    out = [dict(BLOCK_M1=a, BLOCK_N1=b, BLOCK_M2=c, BLOCK_N2=d, num_warps=w, num_stages=s)
           for (a, b, c, d), (w, s) in itertools.product(tiles, warps_stages)]
    if dtype == torch.float32 or head_dim > 128:
        out = [c for c in out if c["BLOCK_N1"] <= 64]
    return _tma_variants(out, quick)


def copy_candidates(quick: bool) -> list[dict]:
    rows = (16, 32, 64) if quick else (8, 16, 32, 64, 128)
    warps = (4, 8) if quick else (1, 2, 4, 8)
    return [dict(BLOCK_R=r, num_warps=w) for r, w in itertools.product(rows, warps)]


# ---------------------------------------------------------------- the search


def search(kernel: str, run: Callable[[dict], object], candidates: list[dict], check: Callable[[dict], float],
           rep_ms: int, log: Callable[[str], None], cuda: bool) -> tuple[dict | None, float, list]:
    """Time run(cfg) for each candidate whose check(cfg) (its error over the allowed error) is <= 1."""
    results, best, best_ms = [], None, math.inf
    for cfg in candidates:
        if not config.is_valid(kernel, cfg):
            continue
        try:
            err = check(cfg)
            if not err <= 1.0:
                log(f"  {kernel} {cfg}: WRONG (error {err:.2f}x the bound), skipped")
                results.append((cfg, None, err))
                continue
            ms = bench_ms(lambda: run(cfg), rep_ms, cuda)
        except Exception as e:  # out of resources, compile failure: not a candidate here
            log(f"  {kernel} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
            results.append((cfg, None, None))
            continue
        log(f"  {kernel} {cfg}: {ms:.3f} ms (error {err:.2f}x the bound)")
        results.append((cfg, ms, err))
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms, results


def tune_attention(b: int, hq: int, hkv: int, s: int, d: int, dtype: torch.dtype, causal: bool, device,
                   which=("fwd", "bwd"), quick: bool = True, rep_ms: int = 50,
                   log: Callable[[str], None] = print) -> dict[str, dict]:
    """Best flash_fwd / flash_bwd configs for one shape, as cache entries {key: cfg + timing}."""
    from autosp.kernels.flash import attention_backward, attention_forward
    from autosp.kernels.reference import TOL, attention_f64, max_err, max_err_bounds, rel_norm

    device = torch.device(device)
    q, k, v, do = attention_inputs(b, hq, hkv, s, d, dtype, device)
    scale = 1.0 / math.sqrt(d)
    # Correctness first, against float64 (never against another config): at a length that keeps
    # the float64 reference small and still has full tiles, a ragged tail and the causal diagonal.
    s_check = min(s, 1024 + 37)
    cq, ck, cv, cdo = attention_inputs(b, hq, hkv, s_check, d, dtype, device, seed=1)
    ref = attention_f64(cq, ck, cv, causal, scale, do=cdo)
    bound = max_err_bounds(cq, ck, cv, cdo, causal, scale, (ref[0], *ref[2:]))

    def check_fwd(c):
        o, lse = attention_forward(cq, ck, cv, causal, scale, c)
        return max(max_err(o, ref[0]) / bound["out"], rel_norm(lse, ref[1]) / TOL[dtype])

    def check_bwd(c):
        o, lse = attention_forward(cq, ck, cv, causal, scale, config.default_config("flash_fwd", device, dtype, d))
        grads = attention_backward(cdo, cq, ck, cv, o, lse, None, causal, scale, c)
        return max(max_err(g, r) / bound[n] for n, g, r in zip("qkv", grads, ref[2:]))

    flops = 4 * b * hq * d * (s * (s + 1) // 2 if causal else s * s)
    entries = {}
    cuda = device.type == "cuda"
    if "fwd" in which:
        best, ms, _ = search("flash_fwd", lambda c: attention_forward(q, k, v, causal, scale, c),
                             fwd_candidates(d, dtype, quick), check_fwd, rep_ms, log, cuda)
        if best is not None:
            key = config.cache_key("flash_fwd", device_name(device), dtype, d, causal, s)
            entries[key] = {**best, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
            log(f"best {key}: {entries[key]}")
    if "bwd" in which:
        o, lse = attention_forward(q, k, v, causal, scale, config.default_config("flash_fwd", device, dtype, d))
        best, ms, _ = search("flash_bwd", lambda c: attention_backward(do, q, k, v, o, lse, None, causal, scale, c),
                             bwd_candidates(d, dtype, quick), check_bwd, rep_ms, log, cuda)
        if best is not None:
            key = config.cache_key("flash_bwd", device_name(device), dtype, d, causal, s)
            entries[key] = {**best, "ms": round(ms, 4), "tflops": round(2.5 * flops / ms / 1e9, 1)}
            log(f"best {key}: {entries[key]}")
    return entries


def tune_copy(b: int, heads: list[int], s_loc: int, d: int, world: int, dtype: torch.dtype, device,
              quick: bool = True, rep_ms: int = 50, log: Callable[[str], None] = print) -> dict[str, dict]:
    """Best layout_copy config for the Ulysses pack of one shape (QKV: [b, s_loc, h, d] views)."""
    from autosp.kernels.ulysses import _pack_heads

    device = torch.device(device)
    xs = [torch.randn(b, s_loc, h, d, device=device).to(dtype).transpose(1, 2) for h in heads]
    reference = _pack_heads(xs, world, "torch")

    def run(cfg):
        with config.override("layout_copy", **cfg):
            return _pack_heads(xs, world, "triton")

    def check(cfg):                 # a copy: exactly the torch path's bytes
        return 0.0 if torch.equal(run(cfg), reference) else math.inf

    best, ms, _ = search("layout_copy", run, copy_candidates(quick), check, rep_ms, log, device.type == "cuda")
    if best is None:
        return {}
    nbytes = 2 * reference.numel() * reference.element_size()
    key = config.cache_key("layout_copy", device_name(device), dtype, d, False, s_loc)
    entry = {**best, "ms": round(ms, 4), "GBps": round(nbytes / ms / 1e6, 1)}
    log(f"best {key}: {entry}")
    return {key: entry}


# ---------------------------------------------------------------- the cache writer


def save_entries(entries: dict[str, dict], path: Path) -> Path:
    """Merge `entries` into the cache file, atomically (autotuners may run side by side)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        merged = json.loads(path.read_text()).get("entries", {})
    except (OSError, ValueError, AttributeError):
        merged = {}
    merged = {**(merged if isinstance(merged, dict) else {}), **entries}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": 1, "entries": dict(sorted(merged.items()))}, f, indent=1)
    os.replace(tmp, path)
    config.reload()  # this process's lookups read the new file
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="fwd,bwd,copy", help="any of fwd, bwd (attention), copy (Ulysses)")
    p.add_argument("--dtypes", default="bf16", help="bf16, fp16, fp32")
    p.add_argument("--head-dims", default="128")
    p.add_argument("--seqs", default="2048,4096,8192,16384,32768", help="attention: sequence lengths")
    p.add_argument("--causal", default="1", help="attention: 1, 0 or 1,0")
    p.add_argument("--heads", type=int, default=32, help="query heads (the copy packs heads, kv, kv)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384, help="attention: batch = max(1, tokens // seq)")
    p.add_argument("--s-locs", default="1024,4096,16384", help="copy: per-rank sequence lengths s/P")
    p.add_argument("--world", type=int, default=8, help="copy: sequence-parallel degree P")
    p.add_argument("--batch", type=int, default=1, help="copy: batch")
    p.add_argument("--full", action="store_true", help="the whole search space (slow); default: quick")
    p.add_argument("--quick", action="store_true", help="the quick space (the default)")
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)

    kernels = a.kernels.split(",")
    if set(kernels) - {"fwd", "bwd", "copy"}:
        p.error(f"--kernels {a.kernels}: use fwd, bwd and/or copy")
    if "copy" in kernels and (a.heads % a.world or a.kv_heads % a.world):
        p.error(f"the copy packs {a.heads}/{a.kv_heads} heads over --world {a.world}: pass multiples of it")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:  # interpreter smoke test: tiny shapes, fp16/fp32 only (bf16 is broken there)
        print("no GPU: smoke-testing the search on CPU tensors through the Triton interpreter")
        a.seqs, a.heads, a.kv_heads, a.tokens, a.rep_ms = "64", 4, 2, 64, 1
        a.s_locs, a.world = "16", 2
        a.dtypes = ",".join(x for x in a.dtypes.split(",") if x != "bf16") or "fp16"
        # interpreter timings are no tuning: kept out of ~/.cache unless a path is given
        if not (a.out or os.environ.get("AUTOSP_KERNEL_CONFIGS")):
            a.out = Path(tempfile.mkdtemp(prefix="autosp_smoke_")) / "kernel_configs.json"
    out = a.out or config.cache_path()
    log = lambda m: print(m, flush=True)  # noqa: E731
    found, t0 = {k: 0 for k in kernels}, time.time()
    for x, d in itertools.product(a.dtypes.split(","), (int(v) for v in a.head_dims.split(","))):
        dt = DTYPES[x]
        attention = [k for k in kernels if k in ("fwd", "bwd")]
        for c, s in itertools.product(a.causal.split(",") if attention else [], a.seqs.split(",")):
            causal, s = bool(int(c)), int(s)
            b = max(1, a.tokens // s)
            log(f"== attention {x} d={d} causal={causal} s={s} b={b} hq={a.heads} hkv={a.kv_heads}")
            entries = tune_attention(b, a.heads, a.kv_heads, s, d, dt, causal, device, which=attention,
                                     quick=not a.full, rep_ms=a.rep_ms, log=log)
            _record(entries, found, out)
        for s_loc in (int(v) for v in a.s_locs.split(",")) if "copy" in kernels else []:
            heads = [a.heads, a.kv_heads, a.kv_heads]
            log(f"== copy {x} d={d} s_loc={s_loc} heads={heads} world={a.world} b={a.batch}")
            _record(tune_copy(a.batch, heads, s_loc, d, a.world, dt, device, quick=not a.full, rep_ms=a.rep_ms,
                              log=log), found, out)
    log(f"wrote {sum(found.values())} entries to {out} in {time.time() - t0:.0f}s: {found}")
    return 0 if all(found.values()) else 1


def _record(entries: dict, found: dict, out: Path) -> None:
    if entries:
        save_entries(entries, out)  # as we go: a timeout keeps what was found
    for key in entries:
        found[{"flash_fwd": "fwd", "flash_bwd": "bwd", "layout_copy": "copy"}[key.split("|")[0]]] += 1


if __name__ == "__main__":
    sys.exit(main())
