"""autosp.kernels against float64 references: flash attention (Triton under the interpreter on
CPU tensors, torch backend), the custom ops' tracing/autograd, the Ulysses layout kernels, and
the config cache. GPU-only checks (bf16, compiled kernels, speed) live in bench/gpu_check.sh.

On CPU the Triton kernels run in Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1
before anything imports triton (autosp/kernels/_triton.py says why it must go first).
"""
import json
import subprocess
import sys

import einops
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import autosp
from autosp.kernels import (flash_attention, ulysses_pack, ulysses_pack_out, ulysses_unpack, ulysses_unpack_heads,
                            ulysses_unpack_out)
from autosp.kernels import config, flash, ulysses
from autosp.kernels._triton import interpreter_problem
from autosp.kernels.reference import TOL, max_err, max_err_bounds, rel_norm as rel, softmax_attention as reference

needs_interpreter = pytest.mark.skipif(interpreter_problem() is not None,
                                       reason=f"Triton interpreter unusable here: {interpreter_problem()}")


@pytest.fixture(autouse=True)
def _no_user_config_cache(tmp_path, monkeypatch):
    # Tuned entries in ~/.cache would change the tilings these tests exercise.
    monkeypatch.setenv("AUTOSP_KERNEL_CONFIGS", str(tmp_path / "kernel_configs.json"))


def inputs(b, hq, hkv, s, d, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g).to(device=device, dtype=dtype) for h in (hq, hkv, hkv)]


def check_fwd_bwd(q, k, v, causal, backend, tol, scale=None, seed=0):
    """Forward and dq, dk, dv of flash_attention against the float64 reference: the relative
    norm within `tol`, and the worst element (a bad row, a missed rescale) within
    reference.max_err_bounds (twice SDPA's own worst element on the same inputs)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=causal, scale=scale, backend=backend)
    ref, _ = reference(*ref_leaves, causal, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
    out.backward(dout)
    ref.backward(dout.double())
    errs = {"out": rel(out, ref)} | {n: rel(a.grad, r.grad) for n, a, r in zip("qkv", leaves, ref_leaves)}
    assert all(e <= tol for e in errs.values()), errs
    worst = {"out": max_err(out, ref)} | {n: max_err(a.grad, r.grad) for n, a, r in zip("qkv", leaves, ref_leaves)}
    if q.dtype != torch.float64:
        bound = max_err_bounds(q, k, v, dout, causal, scale, (ref, *(r.grad for r in ref_leaves)))
        assert all(worst[n] <= bound[n] for n in worst), {"worst": worst, "bound": bound}
    return errs


# ---------------------------------------------------------------- Triton under the interpreter


_MHA, _GQA = (2, 2), (4, 1)


@needs_interpreter
# head dim and dtype paired (the full product doubled the interpreter's share of the suite's 15 minutes); at 127
# every mask, head layout and pair, at 300 (several key blocks, 3x the interpreter's time) a half where each two of
# the three still meet: causal x gqa x fp16, causal x mha x fp32, full x gqa x fp32, full x mha x fp16
@pytest.mark.parametrize("causal, heads, s, d, dtype", [
    *[(c, h, 127, d, t) for c in (True, False) for h in (_MHA, _GQA) for d, t in ((64, torch.float16),
                                                                                  (128, torch.float32))],
    (True, _GQA, 300, 64, torch.float16), (True, _MHA, 300, 128, torch.float32),
    (False, _GQA, 300, 128, torch.float32), (False, _MHA, 300, 64, torch.float16)],
    ids=lambda v: ("mha" if v == _MHA else "gqa") if isinstance(v, tuple) else
    {True: "causal", False: "full", torch.float16: "fp16", torch.float32: "fp32"}.get(v))
def test_triton_matches_float64(causal, heads, s, d, dtype):
    hq, hkv = heads
    seed = 1000 * s + 10 * d + hq + causal  # fresh inputs per case, reproducible
    q, k, v = inputs(1, hq, hkv, s, d, dtype, seed)
    check_fwd_bwd(q, k, v, causal, "triton", TOL[dtype], seed=seed)


@needs_interpreter
@pytest.mark.parametrize("shape", [
    (3, 6, 2, 1, 32),    # one row: dq = dk = 0
    (3, 6, 2, 65, 32),   # one past a tile
    (2, 3, 3, 17, 8),    # head dim below 16: zero-padded
    (1, 4, 2, 40, 80),   # head dim not a power of two: zero-padded
    (1, 2, 1, 33, 256),  # widest head dim
], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_triton_odd_shapes(shape, causal):
    b, hq, hkv, s, d = shape
    q, k, v = inputs(b, hq, hkv, s, d, torch.float32, seed=s * d + causal)
    check_fwd_bwd(q, k, v, causal, "triton", 1e-5, seed=s)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_triton_large_logits(causal, dtype):
    # q and k scaled up: scores of a few hundred, whose row maxima grow from tile to tile, so the
    # running-max rescale of earlier tiles decides the result. Held to the standard (relative norms
    # measured: fp32 3.1e-6 causal, 5.3e-6 full; fp16 8.0e-4, 9.0e-4: the kernel's fp16 rounding
    # grows with the scores, and takes most of the 1e-3)
    q, k, v = inputs(1, 4, 2, 300, 64, dtype, seed=11 + causal)
    ramp = torch.linspace(1, 6, 300).view(1, 1, 300, 1).to(dtype)
    check_fwd_bwd(q * 4, k * ramp, v, causal, "triton", TOL[dtype], seed=3)


@needs_interpreter
def test_tile_offsets_do_not_wrap_at_2_31():
    # A [b, s, h, d] view at s = 128k with 128 heads of 128 has row stride 2**14: row * stride passes
    # 2**31. The interpreter keeps Triton's int32 arithmetic, so the helper the kernels use is
    # checked against Python's integers at such strides (no 8 GiB tensor needed).
    start, stride_r, stride_c, rows, cols = 131072, 128 * 128, 1, 64, 16     # the tile at row 128k
    out, out_t = flash.tile_offsets_of(start, stride_r, stride_c, rows, cols)
    want = torch.tensor([[(start + r) * stride_r + c * stride_c for c in range(cols)] for r in range(rows)])
    assert want.max() > 2**31 and torch.equal(out, want) and torch.equal(out_t, want.T)


@needs_interpreter
def test_triton_non_contiguous_and_scale():
    # [b, s, h, d] storage seen as [b, h, s, d] (what models pass), and a d-strided slice.
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 70, 4, 32, generator=g).transpose(1, 2)
    k = torch.randn(2, 70, 2, 64, generator=g).transpose(1, 2)[..., ::2]
    v = torch.randn(2, 2, 32, 70, generator=g).transpose(2, 3)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    check_fwd_bwd(q, k, v, True, "triton", 1e-5, scale=0.3)


@needs_interpreter
@pytest.mark.parametrize("fwd, bwd", [
    (dict(BLOCK_M=16, BLOCK_N=16), dict(BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16)),
    (dict(BLOCK_M=128, BLOCK_N=16), dict(BLOCK_M1=16, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=16)),
], ids=["square16", "wide128"])
def test_triton_other_tilings(fwd, bwd):
    q, k, v = inputs(1, 4, 2, 150 if fwd["BLOCK_M"] > 16 else 40, 32, torch.float32, seed=11)
    with config.override("flash_fwd", **fwd), config.override("flash_bwd", **bwd):
        for causal in (True, False):
            check_fwd_bwd(q, k, v, causal, "triton", 1e-5)


# Tensor descriptors (TMA): Hopper's default; on CPU the interpreter runs the same kernels on
# host-made descriptors, so the descriptor path's tiles, zero-filled tails and clipped stores are
# checked here at the interpreter's tile sizes.
TMA_TILES = (dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1, TMA=1),
             dict(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, num_warps=4, num_stages=1, TMA=1))


@needs_interpreter
@pytest.mark.parametrize("case", [
    (torch.float16, 64, 127, (4, 1), True, "bhsd"),
    (torch.float32, 32, 300, (2, 2), False, "bhsd"),
    (torch.float32, 128, 300, (4, 2), True, "bshd"),      # a [b, s, h, d] view: descriptors take its strides
], ids=["fp16-gqa-causal-127", "fp32-full-300", "fp32-bshd-causal-300"])
def test_triton_tma_path_matches_float64(case, tma_launches):
    dtype, d, s, (hq, hkv), causal, layout = case
    q, k, v = inputs(1, hq, hkv, s, d, dtype, seed=s + d)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    with config.override("flash_fwd", **TMA_TILES[0]), config.override("flash_bwd", **TMA_TILES[1]):
        check_fwd_bwd(q, k, v, causal, "triton", TOL[dtype], seed=s)
    assert tma_launches == [True] * 3      # forward, dK/dV and dQ all ran on descriptors


@needs_interpreter
def test_tma_falls_back_to_pointers(tma_launches):
    # strides TMA cannot take (a row of 132 bytes, a last-dim stride of 2): pointers, the same result
    g = torch.Generator().manual_seed(5)
    bases = [torch.randn(1, 2, 70, n, generator=g).requires_grad_() for n in (33, 64, 32)]
    q, k, v = bases[0][..., :32], bases[1][..., ::2], bases[2]
    assert "strides" in flash.tma_problem(q) and "last-dim" in flash.tma_problem(k) and flash.tma_problem(v) is None
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference(*ref_in, True, None)
    with config.override("flash_fwd", **TMA_TILES[0]), config.override("flash_bwd", **TMA_TILES[1]):
        out = flash_attention(q, k, v, causal=True, backend="triton")
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), ref_in)
    assert tma_launches == [False] * 3
    assert rel(out, ref) <= 1e-5 and all(rel(a, b) <= 1e-5 for a, b in zip(grads, ref_grads))


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_lse_output_and_its_gradient(backend):
    q, k, v = (t.requires_grad_() for t in inputs(1, 4, 2, 50, 16, torch.float32, seed=3))
    out, lse = torch.ops.autosp.flash_attention(q, k, v, True, None, backend)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, True)
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 50)
    assert rel(lse, ref_lse) < 1e-6
    w = torch.randn(lse.shape, dtype=torch.float64)
    ((lse.double() * w).sum() + out.double().sum()).backward()
    ((ref_lse * w).sum() + ref_out.sum()).backward()
    for a, r in ((q, qr), (k, kr), (v, vr)):
        assert rel(a.grad, r.grad) < 1e-5


# ---------------------------------------------------------------- torch backend


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_torch_backend_equals_sdpa(causal, heads):
    q, k, v = inputs(2, *heads, 77, 32, torch.float32, seed=heads[1] + causal)
    out = flash_attention(q, k, v, causal=causal, backend="torch")
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert (out - sdpa).abs().max().item() <= 1e-6
    assert torch.equal(flash_attention(q, k, v, causal=causal), out)  # "auto" on CPU is torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(2, 6, 2, 127, 64), (3, 6, 2, 1, 32), (1, 4, 4, 300, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_torch_backend_gradients(shape, dtype):
    q, k, v = inputs(*shape, dtype, seed=shape[3])
    check_fwd_bwd(q, k, v, True, "torch", TOL[dtype])


def test_torch_math_path_matches(monkeypatch):
    # The path for GPU tensors Triton cannot take (and for an LSE gradient), exercised on CPU.
    from autosp.kernels import flash_torch

    monkeypatch.setattr(flash_torch, "_CHUNK_ELEMS", 4 * 2 * 30)  # several query chunks
    monkeypatch.setattr(flash_torch, "_use_cpu_flash", lambda q: False)
    q, k, v = inputs(1, 4, 2, 30, 16, torch.float32, seed=5)
    check_fwd_bwd(q, k, v, True, "torch", 1e-5)
    check_fwd_bwd(q, k, v, False, "torch", 1e-5)


def test_gradcheck_float64():
    q, k, v = (t.requires_grad_() for t in inputs(1, 2, 1, 7, 4, torch.float64, seed=1))   # GQA, small: ~1k evals
    assert torch.autograd.gradcheck(lambda *x: flash_attention(*x, backend="torch"), (q, k, v))
    assert torch.autograd.gradcheck(
        lambda *x: torch.ops.autosp.flash_attention(*x, False, 0.5, "torch")[1], (q, k, v))


# ---------------------------------------------------------------- the custom op


@pytest.mark.parametrize("call", ["wrapper", "raw_op"])
def test_traces_as_one_op_with_fake_outputs(call):
    # Through the wrapper (its autograd.Function) and through the op itself (its registered
    # autograd: what a traced graph that holds the op, differentiated by autosp.passes.autodiff, runs).
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = inputs(2, 8, 2, 64, 32, torch.float32, seed=0)
    attend = flash_attention if call == "wrapper" else (
        lambda q, k, v: torch.ops.autosp.flash_attention(q, k, v, True, None, "auto")[0])

    def step(q, k, v):
        return torch.autograd.grad(attend(q, k, v).sum(), (q, k, v))

    leaves = [t.requires_grad_() for t in (q, k, v)]
    gm = make_fx(step, tracing_mode="fake")(*leaves)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.autosp.flash_attention.default) == 1
    assert targets.count(torch.ops.autosp.flash_attention_backward.default) == 1
    fwd = next(n for n in gm.graph.nodes if n.target == torch.ops.autosp.flash_attention.default)
    out, lse = fwd.meta["val"]
    assert out.shape == (2, 8, 64, 32) and lse.shape == (2, 8, 64) and lse.dtype == torch.float32


def test_torch_func_grad_and_flops():
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = inputs(1, 4, 2, 16, 8, torch.float32, seed=2)
    g = torch.func.grad(lambda q: flash_attention(q, k, v).sum())(q)
    qr = q.detach().clone().requires_grad_()
    flash_attention(qr, k, v).sum().backward()
    assert torch.allclose(g, qr.grad)
    with FlopCounterMode(display=False) as fc:
        flash_attention(q.requires_grad_(), k, v, causal=True).sum().backward()
    pairs = 16 * 17 // 2
    assert fc.get_total_flops() == (4 + 10) * 1 * 4 * 8 * pairs


@pytest.mark.parametrize("call, message", [
    (lambda: flash_attention(torch.randn(2, 6, 8, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)),
     "query heads (6) must be a multiple of key/value heads (4)"),
    (lambda: flash_attention(torch.randn(6, 8, 16), torch.randn(6, 8, 16), torch.randn(6, 8, 16)), "must be 4-D"),
    (lambda: flash_attention(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)),
     "one sequence length"),
    (lambda: flash_attention(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16).half(), torch.randn(1, 2, 8, 16)),
     "share one floating dtype"),
    (lambda: flash_attention(*[torch.randn(1, 2, 8, 16)] * 3, backend="cuda"), "backend 'cuda' unknown"),
    (lambda: flash_attention(*[torch.randn(1, 2, 8, 16)] * 3, scale=float("nan")), "finite float"),
    (lambda: flash_attention(*[torch.randn(1, 2, 8, 16).bfloat16()] * 3, backend="triton"), "bfloat16"),
    (lambda: flash_attention(*[torch.randn(1, 2, 8, 16).double()] * 3, backend="triton"), "backend='torch'"),
    (lambda: flash_attention(*[torch.randn(1, 1, 4, 512)] * 3, backend="triton"), "head dim 512"),
])
def test_errors_name_shapes_and_fix(call, message):
    with pytest.raises(autosp.AutospError) as info:
        call()
    assert message in str(info.value)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 8, 16)
    for call in (lambda: flash_attention(q, q, q, backend="triton"), lambda: ulysses_pack([q], 2, backend="triton")):
        with pytest.raises(autosp.AutospError, match="set TRITON_INTERPRET=1 before .*or use backend='torch'"):
            call()
    assert torch.equal(flash_attention(q, q, q), flash_attention(q, q, q, backend="torch"))  # "auto": torch


def test_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, autosp.kernels as K\n"
        "q = torch.randn(1, 2, 8, 16)\n"
        "assert K.flash_attention(q, q, q).shape == q.shape\n"
        "assert K.ulysses_pack([q], 2).numel() == q.numel()\n"
        "try:\n"
        "    K.flash_attention(q, q, q, backend='triton')\n"
        "except Exception as e:\n"
        "    assert type(e).__name__ == 'AutospError' and 'pip install triton' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------- Ulysses layout kernels


def all_to_all(sends, world):
    """all_to_all_single in one process: rank r receives chunk r of every rank's send buffer."""
    return [torch.cat([sends[j].view(world, -1)[r] for j in range(world)]) for r in range(world)]


def ulysses_round(world, b, s_loc, d, heads, backend, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(b, world * s_loc, h, d, generator=g).to(device=device, dtype=dtype)
            for h in heads]  # global [b, S, h, d]
    local = [[t[:, r * s_loc:(r + 1) * s_loc].transpose(1, 2) for t in full] for r in range(world)]
    recv = all_to_all([ulysses_pack(xs, world, backend=backend) for xs in local], world)
    for r in range(world):
        outs = ulysses_unpack(recv[r], heads, b, s_loc, d, world, backend=backend)
        for t, out in zip(full, outs):
            assert torch.equal(out, einops.rearrange(t, "b s (w h) d -> w b h s d", w=world)[r])
        assert all(o.is_contiguous() for o in outs)
        assert all(torch.equal(a, c) for a, c in zip(
            local[r], ulysses_unpack_heads(ulysses_pack(local[r], world, backend=backend), heads, b, s_loc, d,
                                           world, backend=backend)))
    # after attention: rank r holds heads r*h/w.. of the whole sequence, wants its sequence chunk back
    o_full = torch.randn(b, world * s_loc, heads[0], d, generator=g).to(device=device, dtype=dtype)
    o_loc = [einops.rearrange(o_full, "b s (w h) d -> w b h s d", w=world)[r] for r in range(world)]
    recv = all_to_all([ulysses_pack_out(o, world, backend=backend) for o in o_loc], world)
    for r in range(world):
        back = ulysses_unpack_out(recv[r], b, heads[0] // world, s_loc, d, world, backend=backend)
        assert torch.equal(back, o_full[:, r * s_loc:(r + 1) * s_loc].transpose(1, 2))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("world, b, s_loc, d, heads", [
    (2, 1, 8, 64, [4, 2, 2]),
    (4, 3, 5, 24, [8, 4, 4]),   # ragged d (not a power of two)
    (1, 2, 3, 16, [2, 2, 2]),
], ids=["w2", "w4-odd", "w1"])
def test_ulysses_layouts_exact(world, b, s_loc, d, heads, backend):
    ulysses_round(world, b, s_loc, d, heads, backend)


@needs_interpreter
def test_ulysses_triton_fp16_and_autograd():
    ulysses_round(2, 2, 7, 32, [4, 2, 2], "triton", dtype=torch.float16)
    xs = [torch.randn(2, 7, h, 32).transpose(1, 2).requires_grad_() for h in (4, 2)]
    buf = ulysses_pack(xs, 2, backend="triton")
    w = torch.randn_like(buf)
    (buf * w).sum().backward()
    for x, gw in zip(xs, ulysses_unpack_heads(w, [4, 2], 2, 7, 32, 2, backend="torch")):
        assert torch.equal(x.grad, gw)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(world=st.sampled_from([1, 2, 3, 4]), b=st.integers(1, 3), s_loc=st.integers(1, 6),
       d=st.integers(1, 20), hr=st.lists(st.integers(1, 3), min_size=1, max_size=3))
def test_ulysses_layouts_random_shapes(world, b, s_loc, d, hr):
    ulysses_round(world, b, s_loc, d, [world * h for h in hr], "torch", seed=b * 31 + d)


def test_ulysses_gradients_are_inverse_layouts():
    world, b, s_loc, d = 2, 2, 3, 8
    buf = torch.randn(b * 6 * s_loc * d, requires_grad=True)  # heads 4 + 2, world chunks of s_loc
    q, k = ulysses_unpack(buf, [4, 2], b, s_loc, d, world)
    wq, wk = torch.randn_like(q), torch.randn_like(k)
    ((q * wq).sum() + (k * wk).sum()).backward()
    assert torch.equal(buf.grad, ulysses_pack_out_list([wq, wk], world))
    o = torch.randn(b, 2, world * s_loc, d, requires_grad=True)
    send = ulysses_pack_out(o, world)
    w = torch.randn_like(send)
    (send * w).sum().backward()
    assert torch.equal(o.grad, ulysses_unpack(w, [world * 2], b, s_loc, d, world)[0])
    g = torch.func.grad(lambda t: (ulysses_unpack_out(t, b, 2, s_loc, d, world) ** 2).sum())(send.detach())
    assert torch.equal(g, 2 * send.detach())
    o.grad = None     # the op itself is differentiable too (traced graphs call it directly)
    (torch.ops.autosp.ulysses_pack_seq([o], world, "torch") * w).sum().backward()
    assert torch.equal(o.grad, ulysses_unpack(w, [world * 2], b, s_loc, d, world)[0])


def ulysses_pack_out_list(xs, world):
    return ulysses.pack_seq(xs, world, "torch")


@pytest.mark.parametrize("call, message", [
    (lambda: ulysses_pack([torch.randn(1, 3, 4, 8)], 2), "replicate K/V heads"),
    (lambda: ulysses_pack([torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8)], 2), "must share b"),
    (lambda: ulysses_pack(torch.randn(1, 2, 4, 8), 2), "non-empty list"),
    (lambda: ulysses_pack([torch.randn(1, 2, 4, 8)], 0), "world must be a positive int"),
    (lambda: ulysses_unpack(torch.randn(10), [2], 1, 4, 8, 2), "needs 64"),
    (lambda: ulysses_pack_out(torch.randn(1, 2, 5, 8), 2), "pad the sequence"),
    (lambda: ulysses_unpack_out(torch.randn(128), 1, 2, 4, 8, 2, backend="nccl"), "backend 'nccl' unknown"),
])
def test_ulysses_errors(call, message):
    with pytest.raises(autosp.AutospError) as info:
        call()
    assert message in str(info.value)



# ---------------------------------------------------------------- config cache



def test_config_cache_lookup(tmp_path, monkeypatch):
    path = tmp_path / "configs.json"
    monkeypatch.setenv("AUTOSP_KERNEL_CONFIGS", str(path))
    entries = {}

    def save_entries(new):  # what bench/autotune.py does: write the file, then make the reader reread it
        entries.update(new)
        path.write_text(json.dumps({"version": 1, "entries": entries}))
        config.reload()

    cpu, f16 = torch.device("cpu"), torch.float16
    default = config.lookup("flash_fwd", cpu, f16, 64, True, 1000)
    assert default == config.default_config("flash_fwd", cpu, f16, 64)
    tuned = dict(BLOCK_M=32, BLOCK_N=16, num_warps=2, num_stages=1)
    key = config.cache_key("flash_fwd", "cpu-interpreter", f16, 64, True, 8192)
    assert key == "flash_fwd|cpu-interpreter|float16|d64|causal|s8192"
    save_entries({key: {**tuned, "ms": 1.0}})
    assert json.loads(path.read_text())["entries"][key]["BLOCK_M"] == 32
    tuned_as_read = tuned | {"TMA": 0}    # an entry without the optional key: the default's
    assert config.lookup("flash_fwd", cpu, f16, 64, True, 5000) == tuned_as_read      # same bucket
    assert config.lookup("flash_fwd", cpu, f16, 64, True, 100) == tuned_as_read       # nearest bucket
    assert config.lookup("flash_fwd", cpu, f16, 64, False, 8192) == default  # other key fields
    bad = config.cache_key("flash_fwd", "cpu-interpreter", f16, 128, True, 8192)
    save_entries({bad: dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=1)})  # M % N != 0
    assert config.lookup("flash_fwd", cpu, f16, 128, True, 8192) == config.default_config("flash_fwd", cpu, f16, 128)
    with config.override("flash_fwd", BLOCK_M=64, BLOCK_N=64):
        assert config.lookup("flash_fwd", cpu, f16, 64, True, 8192)["BLOCK_N"] == 64
    assert config.lookup("flash_fwd", cpu, f16, 64, True, 8192) == tuned_as_read
    save_entries({key: {**tuned, "TMA": 1}})
    assert config.lookup("flash_fwd", cpu, f16, 64, True, 8192)["TMA"] == 1
    assert not config.is_valid("flash_fwd", {**tuned, "TMA": 2})
    with pytest.raises(autosp.AutospError, match="invalid tiling"):
        with config.override("flash_bwd", BLOCK_N1=16, BLOCK_M1=32):
            pass


def test_rocm_configs_move_tiles_by_pointers_and_were_compiled_without_spills():
    """ROCm has no tensor descriptors: its defaults take the pointer path at every size, and the masked forward
    keeps key tiles of 32 (bench/compile_rocm.py compiled every default for gfx942 and gfx90a: 0 VGPRs spilled;
    the CUDA default's 128-key dK/dV and 64-key masked forward spilled on gfx942)."""
    from autosp.kernels import flash
    gpu = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for d in (64, 128, 256):
            fwd = config.default_config("flash_fwd", gpu, dtype, d, hip=True)
            bwd = config.default_config("flash_bwd", gpu, dtype, d, hip=True)
            assert fwd["TMA"] == 0 and bwd["TMA"] == 0, (dtype, d)
            assert config.is_valid("flash_fwd", fwd) and config.is_valid("flash_bwd", bwd), (dtype, d, fwd, bwd)
            assert flash.terms_forward_config(fwd, hip=True)["BLOCK_N"] <= 32
    hopper = config.default_config("flash_bwd", gpu, torch.bfloat16, 128, capability=(9, 0), hip=False)
    assert hopper["TMA"] == 1


def test_one_config_of_each_kernel_compiles_for_mi300x_without_spills():
    """Triton's AMD backend, offline (no GPU): the flash forward and both backward kernels, causal and with a mask's
    tiles, and the Ulysses layout copy (pack and unpack), each at its ROCm default for fp16, d 64, compiled for gfx942
    as a launch on MI300X would be (bench/compile_rocm.py `one`, in its own process: this one runs Triton's
    interpreter); none spills."""
    import os
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(root / "bench" / "compile_rocm.py"), "one", "--target", "gfx942"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    kernels = [line for line in run.stdout.splitlines() if line.startswith("gfx942 ") and "VGPRs" in line]
    assert len(kernels) == 7 and all(" 0 spilled" in line for line in kernels), run.stdout


def test_lowering_dispatches_attention_to_the_measured_kernel(monkeypatch):
    """The traced (and sharded) program names one attention op, SDPA; lowering calls the kernel that
    lowering's attention_kernel picks by autosp.kernels.dispatch (flash only where measured faster: never on
    CPU), the lowered program equals SDPA either way, and explain's attention summary names the kernel that runs."""
    from autosp.api import attention_summary
    from autosp.ir import lower
    from autosp.ir.lower import attention_kernel
    from autosp.kernels import dispatch

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=g) for _ in range(3))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    graph = autosp.trace(f, q, k, v)
    assert [e.op.name for e in graph.eqns] == ["attention"]
    assert attention_kernel(graph.eqns[0]) == "sdpa"
    assert "flash_attention" not in lower(graph).code and "sdpa" in attention_summary(graph, "cpu")
    monkeypatch.setattr(dispatch, "flash_is_faster", lambda q, causal: True)
    gm = lower(graph)
    assert "autosp.flash_attention" in gm.code
    assert rel(gm(q, k, v)[0], f(q, k, v)) < TOL[torch.float32]
    assert "flash_attention" in attention_summary(graph, "cuda")
