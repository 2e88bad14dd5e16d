"""The memory model's GPU kernel scratch (autosp/remat/liveness.py, WORKSPACE_CUDA_BY_TARGET), held to what the
CUDA caching allocator counted on an H200 (torch 2.11, bf16; `python bench/cuda_workspace.py`, bench/RESULTS.md),
and counted by the planner when, and only when, it plans for a GPU.

On that H200 the least-budget step of a 4-layer Llama 3.2 1B at 32K tokens measured 1.197x its plan before these
were counted (SDPA's cuDNN backward holds 516 MiB of its own) and 1.0004x after.
"""
import pytest
import torch

import autosp
from autosp.remat import liveness as L
from tests.dist import run_ranks

MIB = 2 ** 20

# (model, q shape, k shape, the allocator's scratch in MiB as bench/cuda_workspace.py printed it)
MEASURED = [
    (L.cuda_cudnn_backward, (1, 32, 32768, 64), (1, 8, 32768, 64), 516.0),
    (L.cuda_cudnn_backward, (1, 32, 8192, 64), (1, 32, 8192, 64), 65.0),
    (L.cuda_cudnn_backward, (1, 32, 16384, 128), (1, 8, 16384, 128), 514.0),
    (L.cuda_cudnn_backward, (1, 32, 4096, 128), (1, 32, 4096, 128), 64.5),
    (L.cuda_flash_backward, (1, 32, 32768, 64), (1, 8, 32768, 64), 772.0),
    (L.cuda_flash_backward, (1, 32, 8192, 64), (1, 32, 8192, 64), 129.0),
    (L.cuda_flash_backward, (1, 32, 16384, 128), (1, 8, 16384, 128), 770.0),
    (L.cuda_flash_backward, (1, 32, 4096, 128), (1, 32, 4096, 128), 128.5),
    (L.cuda_efficient_backward, (1, 32, 8192, 64), (1, 32, 8192, 64), 97.1),
    (L.cuda_efficient_backward, (1, 32, 4096, 128), (1, 32, 4096, 128), 96.5),
]


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, device="meta", dtype=dtype)


@pytest.mark.parametrize("model,q,k,mib", MEASURED, ids=lambda x: getattr(x, "__name__", None))
def test_attention_backward_scratch_is_the_measured(model, q, k, mib):
    got = model([_meta(*q), _meta(*q), _meta(*k)], []) / MIB
    assert abs(got - mib) <= 0.15, (model.__name__, q, k, got, mib)


@pytest.mark.parametrize("n,mib", [(4096, 35.4), (32768, 283.5), (3072, 0.0)])
def test_embedding_backward_scratch_is_the_measured(n, mib):
    """128256 x 2048 bf16 rows (Llama 3's vocabulary); the same for distinct ids and one id repeated."""
    got = L.cuda_embedding_backward([_meta(1, n, 2048), _meta(1, n, dtype=torch.long)], [_meta(128256, 2048)]) / MIB
    assert abs(got - mib) <= 0.15, (n, got, mib)


def _embedding_job(rank, world):
    """A step whose peak is the embedding's backward: planned for the GPU it holds the scratch, for the CPU not."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    w = torch.randn(8192, 64, requires_grad=True)
    ids = torch.randint(0, 8192, (1, 8192))

    def fn(params, ids):
        return torch.nn.functional.embedding(ids, params["w"]).sum()

    peaks = {dev: autosp.plan(fn, mesh, {"w": w}, ids, memory_budget=1.0, device=dev,
                              in_specs=(None, "b s")).peak_bytes
             for dev in ("cpu", "cuda")}
    scratch = L.cuda_embedding_backward([_meta(1, 8192 // world, 64, dtype=torch.float32),
                                         _meta(1, 8192 // world, dtype=torch.long)],
                                        [_meta(8192, 64, dtype=torch.float32)])
    return peaks, scratch


def test_planning_for_a_gpu_counts_the_kernel_scratch():
    for peaks, scratch in run_ranks(_embedding_job, 2):
        assert scratch > 0
        assert peaks["cuda"] - peaks["cpu"] == scratch, (peaks, scratch)


def _attention_job(rank, world):
    """A step whose attention is traced on the host (meta tensors, as `autosp plan` traces): each attention backward
    of its plan, the kernel the memory model names for it and the scratch it prices, per device."""
    from torch.distributed.device_mesh import init_device_mesh

    from autosp.api import Sharded
    from autosp.remat import plan_step
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    wq = torch.empty(64, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    x = torch.empty(2, 256, 64, device="meta", dtype=torch.bfloat16)

    def fn(params, x):
        q = (x @ params["wq"]).unflatten(-1, (8, 8)).transpose(1, 2)           # (b, 8, s, 8)
        k = q[:, :2]                                                            # GQA: 2 KV heads
        o = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        return o.float().sum()

    _, local = Sharded(fn, mesh, in_specs=(None, "b s d")).graphs({"wq": wq}, x)
    out = {}
    for dev in ("cpu", "cuda", "h100", "a100", "mi300x"):
        plan, program, _, _ = plan_step(local, 1.0, device=dev)
        bwd = [e for e in program.backward.eqns if L.attention_backward_kernel(e, dev) is not None]
        out[dev] = [(L.attention_backward_kernel(e, dev), L.workspace(e, dev), tuple(e.inputs[1].shape),
                     tuple(e.inputs[2].shape), str(e.op.target)) for e in bwd], plan.peak_bytes
    return out


def test_a_host_traced_attention_backward_is_priced_as_the_gpu_runs_it():
    """A meta trace differentiates attention with ATen's CPU flash backward; a plan for a GPU prices it as the kernel
    that GPU runs (cuDNN on Hopper, FLASH on A100 and MI300X), never at the CPU's scratch or at none."""
    for out in run_ranks(_attention_job, 2):
        rows = {dev: rows for dev, (rows, _) in out.items()}
        assert len(rows["cpu"]) == 1 and "for_cpu_backward" in rows["cpu"][0][4]
        (kind, _, q, k, _), = rows["cuda"]
        assert q == (2, 4, 256, 8) and k == (2, 1, 256, 8)       # this rank's heads of the whole sequence
        qm, km = _meta(*q), _meta(*k)
        want = {"cpu": "cpu_flash", "cuda": "cudnn", "h100": "cudnn", "a100": "flash", "mi300x": "flash"}
        for dev, ((kind, scratch, *_),) in rows.items():
            assert kind == want[dev], (dev, kind)
            if dev != "cpu":
                assert scratch == L.CUDA_ATTENTION_BACKWARD[kind]([qm, qm, km], []) > 0, (dev, scratch)
        peaks = {dev: peak for dev, (_, peak) in out.items()}
        assert peaks["cuda"] == peaks["h100"] and peaks["a100"] == peaks["mi300x"]
        assert peaks["a100"] > peaks["cuda"]                     # FLASH's rounded fp32 dQ, twice, against cuDNN's one


def test_the_backend_sdpa_runs_follows_dtype_head_dim_and_mask():
    q = _meta(1, 8, 64, 64)
    assert L.sdpa_backend("cudnn", q) == "cudnn"
    assert L.sdpa_backend("cudnn", _meta(1, 8, 64, 192)) == "flash"      # cuDNN: head dims up to 128
    assert L.sdpa_backend("flash", q) == "flash"
    assert L.sdpa_backend("cudnn", _meta(1, 8, 64, 64, dtype=torch.float32)) == "efficient"
    assert L.sdpa_backend("cudnn", q, masked=True) == "efficient"


def _eqn(target, args, outs):
    """An equation of `target` over Vars (shapes as given) and constants, as the trace lifts one."""
    from autosp.ir.core import Eqn, Var
    from autosp.ir.ops import op_for
    n = iter(range(100))
    var = lambda t: Var(f"v{next(n)}", t[1], t[0]) if isinstance(t, tuple) and len(t) == 2 and isinstance(t[1], torch.dtype) else t
    return Eqn.make(op_for(target), [var(a) for a in args], {}, [var(o) for o in outs], multi=True)


def test_gpu_and_host_traced_attention_cost_the_same_flops():
    """A step traced on the GPU differentiates attention with cuDNN's ops, one traced on the host with the CPU's: the
    cost model counts both causal, so that the plan made from either is the same."""
    from autosp.remat.cost import flops
    bf, f32 = torch.bfloat16, torch.float32
    q, k, lse = ((2, 8, 512, 64), bf), ((2, 2, 512, 64), bf), ((2, 8, 512), f32)
    cpu_bwd = _eqn(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                   [q, q, k, k, q, lse, 0.0, True], [q, k, k])
    gpu_bwd = _eqn(aten._scaled_dot_product_cudnn_attention_backward.default,
                   [q, q, k, k, q, lse, ((), torch.int64), ((), torch.int64), None, None, None, 512, 512, 0.0, True],
                   [q, k, k])
    assert flops(gpu_bwd) == flops(cpu_bwd) > 0
    cpu_fwd = _eqn(aten._scaled_dot_product_flash_attention_for_cpu.default, [q, k, k, 0.0, True], [q, lse])
    gpu_fwd = _eqn(aten._scaled_dot_product_flash_attention.default, [q, k, k, 0.0, True], [q, lse])
    assert flops(gpu_fwd) == flops(cpu_fwd) > 0


aten = torch.ops.aten


def test_gpu_flag_names_the_target_its_memory_and_the_train_command():
    import argparse

    from autosp.errors import AutospError
    from autosp.remat.cost import GPUS, device_for
    from autosp.run.config import GPU_NAMES, add_step_flags, step_of

    def step(args, verb="plan"):
        p = argparse.ArgumentParser()
        add_step_flags(p, verb)
        return step_of(p.parse_args(args.split()), verb)

    assert set(GPU_NAMES) == set(GPUS)
    s = step("--model tiny --sp 2 --gpu h200")
    assert (s.device, s.target, s.memory_bytes, s.precision) == ("cuda", "h200", 139 * 2**30, "bf16")
    assert "--gpu h200" in s.train_command() and "--memory 139GiB" in s.train_command()
    assert step("--model tiny --sp 2 --gpu a100 --memory 40GiB").memory == "40GiB"
    assert step("--model tiny --device cuda").target == "cuda" and device_for("cuda").attention == "cudnn"
    with pytest.raises(AutospError, match="--gpu h100 --device cpu.*Fix: --device cuda"):
        step("--model tiny --gpu h100 --device cpu")
    assert device_for("a100").attention == "flash" and device_for("mi300x").kind == "cuda"
