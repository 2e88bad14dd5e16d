"""The compiled Triton kernels on a CUDA/ROCm GPU, against float64 (run by bench/gpu_check.sh).

Without a GPU (or without Triton) the module is skipped at import, before it imports the kernels,
so a CPU run reports it as skipped with the reason: what it did not check.
"""
import pytest
import torch

from autosp.kernels._triton import triton_available

if not torch.cuda.is_available():
    pytest.skip("no CUDA/ROCm GPU: the compiled Triton kernels are not checked here (bench/gpu_check.sh "
                "runs them on a GPU)", allow_module_level=True)
if not triton_available():
    pytest.skip("a GPU but no working Triton: the compiled Triton kernels are not checked", allow_module_level=True)

from autosp.kernels import flash_attention  # noqa: E402 - after the skip: nothing to load without a GPU
from autosp.kernels.reference import TOL  # noqa: E402
from tests.test_kernels import check_fwd_bwd, inputs, ulysses_round  # noqa: E402

# ---------------------------------------------------------------- compiled kernels (GPU only)


CUDA_CASES = [  # each distinct (dtype, head dim) costs a compile, so not the full cross product
    ((2, 8, 2, 1000, 128), torch.bfloat16), ((2, 8, 2, 1000, 128), torch.float16),
    ((2, 8, 2, 1000, 128), torch.float32), ((1, 4, 4, 513, 64), torch.float16), ((3, 6, 2, 65, 32), torch.bfloat16),
    ((3, 6, 2, 1, 32), torch.bfloat16), ((1, 2, 1, 100, 256), torch.bfloat16), ((2, 4, 2, 300, 80), torch.bfloat16),
]


@pytest.mark.parametrize("shape, dtype", CUDA_CASES,
                         ids=["x".join(map(str, s)) + "-" + str(t)[6:] for s, t in CUDA_CASES])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cuda_triton_matches_float64(shape, dtype, causal):
    q, k, v = inputs(*shape, dtype, seed=shape[3] + causal, device="cuda")
    check_fwd_bwd(q, k, v, causal, "triton", TOL[dtype], seed=shape[3])
    assert torch.equal(flash_attention(q, k, v, causal=causal), flash_attention(q, k, v, causal=causal,
                                                                                backend="triton"))


@pytest.mark.parametrize("tma", [1, 0], ids=["tma", "pointers"])
def test_cuda_both_tile_paths_match_float64(tma):
    # the default path on Hopper is TMA (config.py); the pointer path stays the fallback for strides a
    # descriptor cannot take: both compiled, at the Hopper default tilings, on a [b, s, h, d] view
    from autosp.kernels import config

    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)
               for t in inputs(2, 8, 2, 777, 128, torch.bfloat16, seed=3, device="cuda"))
    fwd = config.default_config("flash_fwd", q.device, q.dtype, 128, capability=(9, 0))
    bwd = config.default_config("flash_bwd", q.device, q.dtype, 128, capability=(9, 0))
    if tma and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("tensor descriptors need sm_90 or later")
    with config.override("flash_fwd", **dict(fwd, TMA=tma)), config.override("flash_bwd", **dict(bwd, TMA=tma)):
        check_fwd_bwd(q, k, v, True, "triton", TOL[torch.bfloat16], seed=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_ulysses_layouts_exact(dtype):
    ulysses_round(4, 2, 33, 128, [8, 4, 4], "triton", dtype=dtype, device="cuda")
    ulysses_round(2, 1, 64, 80, [4, 2, 2], "auto", dtype=dtype, device="cuda")

@pytest.mark.parametrize("name", ["docs-gqa-batch", "hf-docs-window-gate", "padding-empty-rows"])
def test_cuda_masked_attention_matches_float64(name):
    # masked_attention's terms kernels compiled (one variant per mask form) against float64; fp16, whose
    # bound the interpreted tests hold too (bf16 runs in bench_kernels.py check, bounded by SDPA's error)
    from tests.test_masked import TRITON_CASES, assert_close, qkv, reference, run_triton

    b, hq, hkv, length, d, mask, make_leaves, valid_len = TRITON_CASES[name]
    leaves = [t.cuda() for t in make_leaves(b, length)]
    q, k, v, do = (t.cuda() for t in qkv(b, hq, hkv, length, d, torch.float16, seed=len(name)))
    got = run_triton(q, k, v, do, mask, leaves, valid_len)
    assert_close(got, reference(q, k, v, do, mask, leaves, valid_len), tol=TOL[torch.float16])
