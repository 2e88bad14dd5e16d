"""Launch configurations of the Triton kernels: defaults, the autotuned JSON cache (read only), overrides.

The cache is a JSON file written by `bench/autotune.py` (the only writer):

    {"version": 1, "entries": {"flash_fwd|NVIDIA H200|bfloat16|d128|causal|s8192":
                                {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}}}

Keys: kernel | device name | dtype | head dim | causal or full | sequence bucket (the
layout copy uses "full" and buckets s/P). Its path is `$AUTOSP_KERNEL_CONFIGS`, else
`~/.cache/autosp/kernel_configs.json`.
Lookup order: an `override(...)` in effect, the exact key, the same key at the
nearest tuned sequence bucket (a block size tuned at 8k is a better guess at
16k than the default), the defaults below. An entry that breaks a kernel's
constraints is ignored rather than trusted, so a stale cache never breaks a run. The file is
read once per process and each choice remembered: a launch costs a dict lookup (`reload()`
forgets both; a writer calls it after writing).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import torch

# Keys each kernel's config must hold; anything else in an entry is metadata.
PARAMS = {
    "flash_fwd": ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
    "flash_bwd": ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages"),
    "layout_copy": ("BLOCK_R", "num_warps"),
}
# Keys a config may hold, with the value an entry without them means: TMA 1 loads and stores the
# attention tiles through tensor descriptors (Hopper's copy engine), 0 through pointers (flash.py).
OPTIONAL = {"flash_fwd": {"TMA": 0}, "flash_bwd": {"TMA": 0}, "layout_copy": {}}

_overrides: dict[str, dict] = {}
_loaded: dict[str, dict] = {}            # cache path -> its entries, read once per process
_chosen: dict[tuple, dict] = {}          # (path, key) -> the config lookup() returned


def seq_bucket(seq_len: int) -> int:
    """Sequence lengths share a config within a power of two (at least 128)."""
    return max(128, 1 << max(0, math.ceil(math.log2(max(1, seq_len)))))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_key(kernel: str, device: str, dtype: torch.dtype, head_dim: int, causal: bool, seq_len: int) -> str:
    mode = "causal" if causal else "full"
    return f"{kernel}|{device}|{dtype_name(dtype)}|d{head_dim}|{mode}|s{seq_bucket(seq_len)}"


def cache_path() -> Path:
    env = os.environ.get("AUTOSP_KERNEL_CONFIGS")
    return Path(env) if env else Path.home() / ".cache" / "autosp" / "kernel_configs.json"


def load_cache(path: Path | None = None) -> dict:
    """The cache's entries ({} when there is no file or it is unreadable); the file is read once
    per process (a launch must not stat or parse it), again after reload()."""
    path = str(path or cache_path())
    if path not in _loaded:
        try:
            entries = json.loads(Path(path).read_text()).get("entries", {})
        except (OSError, ValueError, AttributeError):
            entries = {}  # no file, or a corrupt one: it must not stop training; defaults still work
        _loaded[path] = entries if isinstance(entries, dict) else {}
    return _loaded[path]


def reload() -> None:
    """Forget what was read: the next lookup reads the cache file again."""
    _loaded.clear()
    _chosen.clear()


def _pow2(x) -> bool:
    return isinstance(x, int) and x >= 1 and x & (x - 1) == 0


def is_valid(kernel: str, cfg: dict) -> bool:
    """Whether `cfg` satisfies the kernel's tiling constraints (see the kernels' docstrings)."""
    if not all(k in cfg and _pow2(cfg[k]) for k in PARAMS[kernel] if k != "num_stages"):
        return False
    if "num_stages" in PARAMS[kernel] and not (isinstance(cfg["num_stages"], int) and cfg["num_stages"] >= 1):
        return False
    if any(cfg.get(k, v) not in (0, 1) for k, v in OPTIONAL[kernel].items()):
        return False
    blocks = [cfg[k] for k in PARAMS[kernel] if k.startswith("BLOCK_")]
    if kernel.startswith("flash") and min(blocks) < 16:  # tl.dot needs 16 in every dim
        return False
    if kernel == "flash_fwd":
        return cfg["BLOCK_M"] % cfg["BLOCK_N"] == 0
    if kernel == "flash_bwd":
        return cfg["BLOCK_N1"] % cfg["BLOCK_M1"] == 0 and cfg["BLOCK_M2"] % cfg["BLOCK_N2"] == 0
    return True


def cuda_capability(device: torch.device):
    """(major, minor) of a CUDA device, None for anything else (ROCm included) or when there is none."""
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def default_config(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                   capability: tuple | None = None, hip: bool | None = None) -> dict:
    """Untuned configs that are correct everywhere and reasonable on H100/H200-class GPUs and MI300X/MI250X.
    `capability`: the CUDA device's (major, minor), asked of the device when not given; `hip`: a ROCm GPU (by
    default: this torch's build), whose configs take no tensor descriptors (bench/compile_rocm.py)."""
    if device.type == "cpu":
        # The interpreter pays per Triton op, not per element: few programs, but still
        # several tiles per row at test sizes so the diagonal and tail paths run.
        return {
            "flash_fwd": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1, TMA=0),
            "flash_bwd": dict(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, num_warps=4, num_stages=1, TMA=0),
            "layout_copy": dict(BLOCK_R=64, num_warps=4),
        }[kernel]
    hip = torch.version.hip is not None if hip is None else hip
    if capability is None and not hip:
        capability = cuda_capability(device)
    tma = int(not hip and capability is not None and capability >= (9, 0))   # Hopper and later: the copy engine
    wide = head_dim > 128 or dtype == torch.float32  # registers / shared memory run out first
    # Hopper, 16-bit, d <= 128: sizes chosen by compiling for sm_90 (bench/compile_sm90.py, RESULTS.md): dK/dV
    # keeps 64 keys (128 spills their fp32 accumulators); its warps, by timing on an H200 (below).
    if kernel == "flash_fwd":
        if wide:
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1 if hip else 2, TMA=tma)
        return dict(BLOCK_M=128, BLOCK_N=128 if tma else 64, num_warps=8 if head_dim > 64 else 4,
                    num_stages=1 if hip else 3, TMA=tma)
    if kernel == "flash_bwd":
        if wide:
            return dict(BLOCK_M1=16, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=16, num_warps=4, num_stages=1, TMA=tma)
        if tma:               # 4 warps, not 8: 14.9 against 29.2 ms on an H200 (bf16, d 128, s 16K, GQA 4:1;
            # bench/autotune.py, each checked against float64), though dK/dV spills 416 B at 4 warps on sm_90
            return dict(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=128, BLOCK_N2=32, num_warps=4, num_stages=3, TMA=1)
        if hip:               # gfx942 (bench/compile_rocm.py): 128 keys spill dK/dV's accumulators, 8 warps spill too
            return dict(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, num_warps=4, num_stages=1, TMA=0)
        return dict(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, num_warps=4, num_stages=1 if hip else 3,
                    TMA=0)
    if kernel == "layout_copy":
        return dict(BLOCK_R=32, num_warps=4)
    raise KeyError(kernel)


def lookup(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool,
           seq_len: int) -> dict:
    """The launch config for one call (see the module docstring for the order)."""
    if kernel in _overrides:
        return dict(_overrides[kernel])
    from autosp.kernels._triton import device_name

    path = os.environ.get("AUTOSP_KERNEL_CONFIGS") or ""
    memo = (path, kernel, device.type, device.index, dtype, head_dim, causal, seq_bucket(seq_len))
    if memo not in _chosen:
        _chosen[memo] = _choose(kernel, device, device_name(device), dtype, head_dim, causal, seq_len)
    return dict(_chosen[memo])


def _nearest(entries: dict, key: str):
    """The entry under `key`, else the one with the same key at the nearest sequence bucket, else None."""
    if key in entries or not entries:
        return entries.get(key)
    prefix, want = key.rsplit("|s", 1)
    near = [(abs(math.log2(int(b) / int(want))), k) for k in entries
            for p, b in [k.rsplit("|s", 1)] if p == prefix and b.isdigit()]
    return entries[min(near)[1]] if near else None


def _choose(kernel, device, name, dtype, head_dim, causal, seq_len) -> dict:
    cfg = _nearest(load_cache(), cache_key(kernel, name, dtype, head_dim, causal, seq_len))
    default = default_config(kernel, device, dtype, head_dim)
    if cfg is not None and is_valid(kernel, cfg):  # an entry without an optional key keeps the default's
        return {k: cfg[k] for k in PARAMS[kernel]} | {k: cfg.get(k, default[k]) for k in OPTIONAL[kernel]}
    return default


def measured_speedup(device_name: str, dtype: torch.dtype, head_dim: int, causal: bool, seq_len: int) -> float | None:
    """SDPA's time over autosp's flash kernels' (forward + backward) at this shape, as the GPU check
    measured it ("flash_vs_sdpa" entries: {"speedup": x}), at the nearest measured length; None when
    nothing was measured on this device. The sharding pass uses the kernels only where this is > 1."""
    entry = _nearest(load_cache(), cache_key("flash_vs_sdpa", device_name, dtype, head_dim, causal, seq_len))
    x = entry.get("speedup") if isinstance(entry, dict) else None
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) and x > 0 else None


@contextlib.contextmanager
def override(kernel: str, **params):
    """Force one kernel's config (autotuners, tests): `with override("flash_fwd", BLOCK_M=32, ...)`."""
    from autosp.errors import AutospError

    if kernel not in PARAMS:
        raise AutospError(f"config.override: unknown kernel {kernel!r}; use one of {sorted(PARAMS)}")
    cfg = {**default_config(kernel, torch.device("cuda"), torch.float16, 64), **params}
    if not is_valid(kernel, cfg):
        raise AutospError(
            f"config.override({kernel!r}, {params}): invalid tiling; blocks must be powers of two "
            f"(>= 16 for attention) and the stationary block a multiple of the streamed one")
    old = _overrides.get(kernel)
    _overrides[kernel] = cfg
    try:
        yield cfg
    finally:
        if old is None:
            _overrides.pop(kernel, None)
        else:
            _overrides[kernel] = old
