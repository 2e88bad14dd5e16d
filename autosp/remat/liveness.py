"""The memory model: storage-aware liveness over a program's executed order, in bytes per rank.

Each equation allocates its outputs' storages (views allocate nothing: they share their
base's storage, from the op schema's alias annotations) plus a transient workspace while it
runs (collective buffers, kernel scratch; `workspace`). A storage is freed after the last
equation that reads any value living in it, as the lowered fx code does (`x = None` after a
value's last use). Graph outputs and `keep` names stay alive to the end.

`simulate` gives the bytes live after each equation and the peak during it; the remat
planner uses the same rules to build its memory rows, and the plan's `peak_bytes` is this
simulation of the rewritten forward and backward programs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autosp.ir.aliases import aliases, roots
from autosp.ir.core import Eqn, Graph, PerEqn, Var

aten = torch.ops.aten


def nbytes(v: Var) -> int:
    return v.nbytes()


# ---------------------------------------------------------------- workspaces (calibrated)

def _bytes_in(e: Eqn) -> int:
    return sum(nbytes(v) for v in e.inputs)


def _bytes_out(e: Eqn) -> int:
    return sum(nbytes(v) for v in e.outputs)


# op name -> transient bytes while it runs, beyond its outputs. Measured with the profiler's
# allocation events on CPU (tests/test_remat_memory.py holds the table to the measurement).
WORKSPACE = {
    "all_to_all": lambda e: 2 * _bytes_in(e),          # the packed send buffer and the receive buffer
    "all_gather_seq": lambda e: 2 * _bytes_out(e),     # every rank's chunk, then their concatenation
    "shard_slice": lambda e: 2 * _bytes_out(e),        # the padded chunk before its clone
    "unshard_grad": lambda e: _bytes_out(e),
    "all_gather_param": lambda e: _gather_param(e),
    # ring attention: the K/V block in flight beside the one in use, and fp32 accumulators of the
    # output (forward) or of dQ and the travelling dK/dV (backward)
    "ring_attention": lambda e: _ring_workspace(e, forward=True),
    "ring_attention_backward": lambda e: _ring_workspace(e, forward=False),
    # the masked variant's blocks run the math path: their scores are counted in _ring_workspace
    "ring_masked_attention": lambda e: _ring_workspace(e, forward=True, masked=True),
    "ring_masked_attention_backward": lambda e: _ring_workspace(e, forward=False, masked=True),
    "zigzag_exchange": lambda e: 2 * _bytes_in(e),
    # the positions sent and those received, each at most the halo (the output, or the gradient's input)
    "halo_exchange": lambda e: 2 * _bytes_out(e),
    "halo_grad": lambda e: 2 * _bytes_in(e),
    "reduce_scatter_param": lambda e: _reduce_scatter_param(e),
}


def _ring_workspace(e: Eqn, forward: bool, masked: bool = False) -> int:
    """Ring attention (autosp/ring.py), counted from what the op allocates: the K/V block in flight, fp32
    accumulators (the output and its lse; dQ and this rank's share of dK/dV, the travelling dK/dV received
    and sent), contiguous copies of the query-side slots (zigzag), and one block's temporaries: its K/V
    slots, K/V expanded to the query heads (GQA), its results, and the CPU kernel's own workspace."""
    q, k, v = e.inputs[:3] if forward else e.inputs[1:4]
    zigzag = e.var_args()[0][6 if forward else 9]
    f = 0.5 if zigzag else 1.0                       # a block pairs one chunk of queries with one of keys
    blk = int(q.shape[-2] * f)
    group = q.shape[-3] // k.shape[-3]
    ct = 8 if q.dtype == torch.float64 else 4
    kv, kv_n = nbytes(k) + nbytes(v), k.numel() + v.numel()
    rows = q.numel() // q.shape[-1]                  # lse entries
    expanded = group * kv * f if group > 1 else 0
    qs, ks = _cpu_flash_split(blk, blk)
    if forward:
        copies = nbytes(q) if zigzag else 0
        acc = ct * (q.numel() + rows)
        # during the kernel: K/V expanded to the query heads and the kernel's own buffers (its output
        # and lse are counted with the merge, which outlives it)
        block = expanded + nbytes(q) * f + ct * rows * f
        kernel = 4 * (torch.get_num_threads() * (qs * ks + 2 * qs + qs * q.shape[-1]))
        if masked:                                   # the math path: one block's scores
            kernel = ct * rows * f * blk
    else:
        from autosp.remat.cost import ring_size
        r = ring_size(e)
        copies = (3 * nbytes(q) + ct * rows) if zigzag else 0
        # this rank's dK/dV share; from the second step on also the travelling grads received and those sent;
        # K/V in flight on every step but the last
        share = ct * kv_n
        travel = max(kv + share, 3 * share) if r == 2 else (kv + 3 * share if r > 2 else share)
        acc = ct * q.numel() + travel
        # the block's K/V slots (zigzag), K/V expanded to the query heads, the kernel's dQ, dK, dV (expanded)
        block = kv * f * (1 if zigzag else 0) + expanded + nbytes(q) * f + (expanded or kv * f)
        kernel = 4 * (torch.get_num_threads() * 2 * qs * ks + q.numel() * f + qs)
        if masked:                                   # one block's scores at a time and the slots' rows
            kernel = ct * (rows * f * blk + 2 * q.numel() + rows)
        return int(copies + acc + block + kernel)
    return int(kv + copies + acc + block + kernel)


def _ranks(e: Eqn, group_pos: int, chunk: int, rows: int) -> int:
    """The size of a collective's group; estimated from its rows where the group is not at hand."""
    from autosp.collectives import group_size
    try:
        return group_size(e.var_args()[0][group_pos])
    except Exception:  # noqa: BLE001 - a graph printed or planned away from its process group
        return -(-rows // max(chunk, 1))


def _gather_param(e: Eqn) -> int:
    # the shard cast to the compute dtype, then every rank's padded shard; the output is that buffer
    # itself when no padding is dropped, else a copy of its first `rows`
    x, out = e.inputs[0], e.outputs[0]
    rows = out.shape[0]
    p = _ranks(e, 2, x.shape[0], rows)
    cast = x.numel() * out.dtype.itemsize if out.dtype != x.dtype else 0
    padded = p * x.shape[0]
    return cast + (nbytes(out) * padded // max(rows, 1) if padded != rows else 0)


def _reduce_scatter_param(e: Eqn) -> int:
    # the padded whole gradient in the reduction dtype, and the reduced shard before its cast
    g, out = e.inputs[0], e.outputs[0]
    args = e.var_args()[0]
    chunk, reduce_dtype = out.shape[0], args[3]
    p = _ranks(e, 2, chunk, g.shape[0])
    per_row = reduce_dtype.itemsize * (g.numel() // max(g.shape[0], 1))
    return p * chunk * per_row + (chunk * per_row if reduce_dtype != out.dtype else 0)


def _cpu_flash_split(q_len: int, kv_len: int) -> tuple[int, int]:
    """The (query, key) block sizes ATen's CPU flash attention picks for these lengths."""
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def _cpu_flash_forward(e: Eqn) -> int:
    # per thread: scores of one block, its row max and sum, and an accumulator of the block's rows,
    # in the accumulation type; half-precision inputs add the block's scores in their own type
    q, k = e.inputs[0], e.inputs[1]
    qs, ks = _cpu_flash_split(q.shape[-2], k.shape[-2])
    acc = 8 if q.dtype == torch.float64 else 4
    per_thread = acc * (qs * ks + 2 * qs + qs * q.shape[-1])
    if q.dtype.itemsize < 4:
        per_thread += q.dtype.itemsize * qs * ks
    return torch.get_num_threads() * per_thread


def _cpu_flash_backward(e: Eqn) -> int:
    # per thread: the block's probabilities and their gradient in the accumulation type (and, in half
    # precision, again in the input's); shared: a query-sized buffer in the input's type and a row of the
    # accumulation type (fp32 and fp64 measured exactly). Half precision's GEMMs (oneDNN) also take a scratch
    # per call and thread: an envelope of what bench/cpu_attention_scratch.py measured (x86 with AMX; heads of 16
    # to 256, lengths 32 to 2048, 1 to 4 threads): the larger of a packed K/V block (key block by head dim, each
    # rounded up to 32) and 640 B per query row, plus 17,540 B. Never under there; over by at most 32 KiB at one
    # thread (heads up to 128), up to 80-102 KiB a thread at 2 to 4, where oneDNN shares packed blocks
    q, k = e.inputs[1], e.inputs[2]
    qs, ks = _cpu_flash_split(q.shape[-2], k.shape[-2])
    acc = 8 if q.dtype == torch.float64 else 4
    threads = torch.get_num_threads()
    if q.dtype.itemsize >= 4:
        return acc * (threads * 2 * qs * ks + q.numel() + qs)
    item = q.dtype.itemsize
    scratch = max(2 * _up(ks, 32) * _up(q.shape[-1], 32), 640 * qs) + 17540
    return item * q.numel() + threads * (2 * qs * ks * (acc + item) + scratch) + acc * qs


# aten overload -> its workspace, where the canonical op name covers kernels that differ (every
# SDPA overload is "attention"). Measured with the profiler's allocation events, by thread count.
# Counted in a CPU step only: a program traced on the host is also how a GPU step is planned (autosp
# plan, meta models), and there the GPU's kernels run, with their own scratch (WORKSPACE_CUDA_BY_TARGET).
_CPU_FLASH = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
WORKSPACE_BY_TARGET = {}
if _CPU_FLASH is not None:
    WORKSPACE_BY_TARGET[_CPU_FLASH.default] = _cpu_flash_forward
if _CPU_FLASH_BWD is not None:
    WORKSPACE_BY_TARGET[_CPU_FLASH_BWD.default] = _cpu_flash_backward


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def _gqa_expanded(q, k) -> int:
    """dK and dV at every query head, before their sum over each group: what a GPU attention backward holds
    under GQA (0 without)."""
    b, hq, _, d = q.shape
    return 0 if k.shape[1] == hq else 2 * q.dtype.itemsize * b * k.shape[-2] * hq * d


# A GPU kernel's scratch, f(inputs, outputs) of anything with .shape and .dtype, so that bench/cuda_workspace.py
# holds each to the CUDA caching allocator's count at real sizes. Measured on an H200 (torch 2.11, bf16;
# bench/RESULTS.md, "The whole step on an H200"); a kernel not named runs with no scratch of its own, or one that
# persists from the first step (cuBLAS's workspace).

def cuda_flash_backward(inputs, outputs) -> int:
    """SDPA's FLASH backend (FlashAttention-2): fp32 dQ scratch twice [b, s_q rounded up to 128, h_q, d rounded
    up to 32 (64 above 128)] and fp32 softmax_d [b, h_q, s_q rounded], plus the GQA expansion."""
    q, k = inputs[1], inputs[2]
    b, hq, sq, d = q.shape
    sq_r = _up(sq, 128)
    return 4 * b * hq * sq_r + 8 * b * sq_r * hq * _up(d, 32 if d <= 128 else 64) + _gqa_expanded(q, k)


def cuda_cudnn_backward(inputs, outputs) -> int:
    """SDPA's cuDNN backend (the one SDPA picks on an H200): fp32 dQ [b, s_q, h_q, d] and fp32 statistics
    [b, h_q, s_q], plus the GQA expansion."""
    q, k = inputs[1], inputs[2]
    b, hq, sq, d = q.shape
    return 4 * b * hq * sq + 4 * b * sq * hq * d + _gqa_expanded(q, k)


def cuda_efficient_backward(inputs, outputs) -> int:
    """SDPA's EFFICIENT backend (memory-efficient attention; no GQA): an fp32 dQ accumulator and a copy in the
    input's type [b, s_q, h, d], and fp32 row terms [b, h, s_q] (0.1 MiB under at 8192 x 64)."""
    b, hq, sq, d = inputs[1].shape
    return 4 * b * hq * sq + (4 + inputs[1].dtype.itemsize) * b * sq * hq * d


def cuda_embedding_backward(inputs, outputs) -> int:
    """embedding_dense_backward past 3072 indices (below: a kernel with no scratch): the indices sorted with
    their positions, then partial sums in the accumulation type (fp32 for half precision), one row per partial
    segment, at most n / 10 + min(n, rows) of them, whatever the ids (0.2 MiB under at 32K tokens)."""
    grad, idx = inputs[0], inputs[1]
    n = 1
    for size in idx.shape:
        n *= size
    if n <= 3072:
        return 0
    rows, width = outputs[0].shape[0], outputs[0].shape[-1]
    segments = min(n, rows)
    partials = n // 10 + segments
    return max(4, grad.dtype.itemsize) * width * partials + 8 * (4 * n + 2 * segments + partials)


WORKSPACE_CUDA_BY_TARGET = {getattr(aten, name).default: f for name, f in (
    ("_scaled_dot_product_flash_attention_backward", cuda_flash_backward),
    ("_scaled_dot_product_cudnn_attention_backward", cuda_cudnn_backward),
    ("_scaled_dot_product_efficient_attention_backward", cuda_efficient_backward),
    ("embedding_dense_backward", cuda_embedding_backward)) if hasattr(aten, name)}

CUDA_ATTENTION_BACKWARD = {"cudnn": cuda_cudnn_backward, "flash": cuda_flash_backward,
                           "efficient": cuda_efficient_backward}


def sdpa_backend(gpu: str, q, masked: bool = False) -> str:
    """The SDPA backend a GPU runs for attention on `q` (anything with .shape and .dtype): its preferred one
    (cost.Device.attention: cuDNN on Hopper and Blackwell, FLASH on Ampere and MI300X) where that takes these
    inputs, else the next torch tries. FLASH and cuDNN take half precision only, cuDNN head dims up to 128, FLASH
    up to 256; a mask tensor goes to EFFICIENT."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    if masked or not half or q.shape[-1] > 256:
        return "efficient"
    if gpu == "cudnn" and q.shape[-1] <= 128:
        return "cudnn"
    return "flash"


def _host_traced_backward(gpu: str):
    """The scratch of the GPU backward that runs an attention backward traced on the host (a meta or CPU trace:
    ATen's CPU flash backward, whose arguments are the GPU backwards' grad_out, query, key, value, out, lse)."""
    def scratch(e: Eqn) -> int:
        masked = len(e.inputs) > 6                     # attn_mask, the one optional tensor after lse
        kind = sdpa_backend(gpu, e.inputs[1], masked)
        extra = _gqa_expanded(e.inputs[1], e.inputs[2]) if kind == "efficient" else 0   # K/V repeated to q's heads
        return CUDA_ATTENTION_BACKWARD[kind](e.inputs, e.outputs) + extra
    return scratch


_GPU_TABLES: dict[str, dict] = {}


def _gpu_table(device: str) -> dict:
    """aten overload -> scratch(e) on the GPU `device` names (cost.device_for): the GPU overloads as measured, and
    the host-traced attention backward priced as the kernel that GPU runs."""
    table = _GPU_TABLES.get(device)
    if table is None:
        from autosp.remat.cost import device_for
        table = {t: (lambda f: lambda e: f(e.inputs, e.outputs))(f) for t, f in WORKSPACE_CUDA_BY_TARGET.items()}
        if _CPU_FLASH_BWD is not None:
            table[_CPU_FLASH_BWD.default] = _host_traced_backward(device_for(device).attention)
        _GPU_TABLES[device] = table
    return table


_GPU_BACKWARDS = {getattr(aten, f"_scaled_dot_product_{kind}_attention_backward").default: kind
                  for kind in CUDA_ATTENTION_BACKWARD
                  if hasattr(aten, f"_scaled_dot_product_{kind}_attention_backward")}


def attention_backward_kernel(e: Eqn, device: str) -> str | None:
    """The kernel that runs attention backward `e` on `device` ('cpu', 'cuda', a GPU name) as the memory model prices
    it: 'cpu_flash', 'cudnn', 'flash', 'efficient', 'autosp' (autosp::sdpa_backward), 'masked blockwise' or 'masked
    triton' (autosp::masked_attention_backward); None for an equation that is no attention backward."""
    from autosp.remat.cost import device_for
    if e.op.name == "sdpa_backward":
        return "autosp"
    if e.op.name == "masked_attention_backward":
        return "masked triton" if _masked_runs_triton(e, device) else "masked blockwise"
    if e.op.target in _GPU_BACKWARDS:
        return _GPU_BACKWARDS[e.op.target]
    if _CPU_FLASH_BWD is None or e.op.target is not _CPU_FLASH_BWD.default:
        return None
    dev = device_for(device)
    return "cpu_flash" if dev.kind == "cpu" else sdpa_backend(dev.attention, e.inputs[1], len(e.inputs) > 6)


def _autosp_sdpa_backward(e: Eqn, device: str) -> int:
    """autosp::sdpa_backward (passes/attention_backward.py): on a GPU autosp's Triton kernel (two fp32 rows per query
    row); on the CPU ATen's flash backward over K/V repeated to the query heads (their copies, the kernel's scratch
    at those shapes, dK/dV at every query head before their sum), and the copies into the inputs' layouts."""
    from autosp.kernels.sdpa_backward import scratch_bytes
    from autosp.remat.cost import device_for
    q, k = e.inputs[1], e.inputs[2]
    if device_for(device).kind != "cpu":
        return scratch_bytes(q, k, "cuda")
    group = q.shape[1] // k.shape[1]
    expanded = 0 if group == 1 else 2 * group * nbytes(k)
    wide = _Shaped(q.shape[:1] + (q.shape[1],) + k.shape[2:], k.dtype)
    kernel = _cpu_flash_backward(_Inputs((q, q, wide)))
    return 2 * expanded + kernel + nbytes(q) + 2 * nbytes(k)


@dataclass(frozen=True)
class _Shaped:
    shape: tuple
    dtype: torch.dtype

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class _Inputs:
    inputs: tuple


def _masked_args(e: Eqn):
    """(q, k, v, leaves, mask, valid_len, backend) of autosp::masked_attention or its backward."""
    args = e.var_args()[0]
    if e.op.name == "masked_attention":
        q, k, v, leaves, mask, _, valid_len, backend = args[:8]
    else:
        _, q, k, v, _, _, leaves, mask, _, valid_len, backend = args[:11]
    return q, k, v, [x for x in leaves if isinstance(x, Var)], mask, valid_len, backend


def _masked_runs_triton(e: Eqn, device: str) -> bool:
    """Whether masked attention `e` runs autosp's Triton kernels on `device`, not the blockwise torch path: a GPU, and
    nothing kernels/masked.py's dispatch finds the kernels cannot take (the mask, the dtype, the head dim)."""
    from autosp.kernels.masked import _kernel_problem
    from autosp.remat.cost import device_for
    q, _, _, leaves, mask, _, backend = _masked_args(e)
    if backend in ("torch", "triton"):
        return backend == "triton"
    return device_for(device).kind != "cpu" and _kernel_problem(q, leaves, mask) is None


def _masked_attention(e: Eqn, device: str) -> int:
    """autosp::masked_attention and its backward where the blockwise torch path runs them (kernels/masked.py: the
    CPU, or a GPU whose Triton kernels cannot take the mask or the dtype; the Triton kernels are not priced here).
    Counted from what that path allocates: q as GQA rows scaled (K/V cast where not the compute dtype), the row
    block's accumulator and row statistics, one block's scores [b*hkv, n*g, m] with the mask block and its negation;
    where more than one block runs, the previous block's scores (and, backward, its dS) are still held while the next
    are made. Backward: dO and O as rows, their row sums, the lse as rows, dQ/dK/dV accumulated as rows (the outputs
    where the layouts agree), the row block's dQ and -delta, dS beside P, and one dK (dV) product. Exact where the
    largest block's mask is partial (a bool mask along queries and keys); over where a mask skips it or lets it all
    through (held in tests/test_masked.py)."""
    from autosp.kernels.masked import _compute_dtype, block_sizes
    from autosp.kernels.maskfn import parse
    from autosp.kernels.maskterms import leaf_kinds
    if _masked_runs_triton(e, device):
        return 0
    q, k, v, leaves, mask, valid_len, _ = _masked_args(e)
    kinds = leaf_kinds(leaves)
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    if 0 in (b, hq, s, d) or valid_len <= 0:
        return 0
    g, ct = hq // hkv, _compute_dtype(q.dtype)
    c = ct.itemsize
    bq, bk = block_sizes()
    n, m = min(bq, s), min(bk, valid_len)
    several = -(-s // bq) * -(-valid_len // bk) > 1
    scores = b * hkv * n * g * m * c                          # one block's scores (backward: P or dS)
    row = b * hkv * n * g * c                                 # a row block's statistic (one per query row)
    acc = row * d                                             # a row block's accumulator (forward: out; backward: dQ)
    batch = max([x.shape[0] for x in leaves if len(x.shape) == 3 and x.shape[0] > 1] or [1])
    if parse(mask).kind(kinds) == "bool":
        blk, negated = batch * n * m, batch * n * m           # the mask block and ~mask in masked_fill_
    else:
        blk, negated = batch * n * m * 4, (batch * n * m * c if c != 4 else 0)
    cast = 0 if k.dtype == ct else (k.numel() + v.numel()) * c
    rows = q.numel() * c                                      # q * scale as GQA rows
    if e.op.name == "masked_attention":
        # the row form of out and lse are the outputs' bytes until the end, where a GQA group's are copied out
        # while the last block's scores, mask and statistics are still held
        own = (0 if (g == 1 and q.dtype == ct) else rows) + (0 if g == 1 else b * hq * s * c)
        held = rows + cast + acc
        if several:     # the previous block's scores, shift and alpha held (and one more statistic under a window)
            during = 2 * scores + blk + negated + 5 * row
        else:
            during = scores + blk + negated + 2 * row
        return int(held + max(during, own + scores + blk + 4 * row))
    dout = 0 if (g == 1 and q.dtype == ct) else rows          # dO as rows
    total = b * hq * s * c                                    # delta and the lse as rows, each [b*hkv, L*g]
    own = 0 if (g == 1 and q.dtype == ct) else rows           # dQ copied out of its rows at the end
    own += 0 if k.dtype == ct else (k.numel() + v.numel()) * c
    held = rows + cast + dout + 2 * total + acc + row         # + the row block's dQ and -delta
    kv_block = b * hkv * m * d * c                            # dS^T Q (P^T dO): dK's (dV's) block product
    if several:                                               # P and dS of the previous block held as P is made
        during = max(3 * scores + blk + negated, 2 * scores + blk + kv_block)
    else:
        during = max(scores + blk + negated, 2 * scores + blk + kv_block)
    return int(held + max(during, own + 2 * scores + blk))


_BY_DEVICE = {"sdpa_backward": _autosp_sdpa_backward, "masked_attention": _masked_attention,
              "masked_attention_backward": _masked_attention}


def workspace(e: Eqn, device: str = "cpu") -> int:
    """Transient bytes while `e` runs on `device` ('cpu', 'cuda' or a GPU of cost.GPUS), beyond its outputs: the
    kernel that device runs for it, whichever device traced it."""
    f = _scratch_of(e, device)
    return f(e) if f is not None else 0


# ---------------------------------------------------------------- the simulation

@dataclass(frozen=True, slots=True)
class Timeline:
    start: int                     # bytes live before the first equation (counted inputs)
    after: tuple[int, ...]         # bytes live after each equation
    during: tuple[int, ...]        # peak bytes while each equation runs
    end: int                       # bytes live at the end (outputs and kept values)
    at_peak: tuple[tuple[str, int], ...] = ()   # (storage, bytes) live at the peak, if asked for
    tracked: tuple[int, ...] = ()   # bytes of the `track`ed values' storages live: at the start, during each
                                    # equation, at the end (len(during) + 2), if asked for

    @property
    def peak(self) -> int:
        return max((self.start, self.end) + self.during)

    def argmax(self) -> int:
        return max(range(len(self.during)), key=self.during.__getitem__) if self.during else -1


def last_uses(graph: Graph) -> dict[str, int]:
    """Var name -> index of the last equation that reads it (-1: never read)."""
    last: dict[str, int] = {}
    for i, e in enumerate(graph.eqns):
        for x in e.inputs:
            last[x.name] = i
    return last


def simulate(graph: Graph, counted=(), keep=(), base: int = 0, host=(), detail: bool = False,
             device: str = "cpu", track=None) -> Timeline:
    """Bytes live through `graph`. Inputs named in `counted` (and their storages) count from the
    start and are freed after their last use; other inputs and constants are not counted (they
    live before and after the program). `keep`: names alive to the end besides the outputs.
    `host`: names of values in host memory (offloaded copies), which the device does not hold.
    `device`: the kind of device the step runs on ('cpu', 'cuda'), for kernels' workspaces.
    `track`: names whose storages' bytes are followed apart (Timeline.tracked), e.g. the values a
    forward saves for its backward."""
    root = roots(graph)
    counted = set(counted) - set(host)
    host = set(host)
    size: dict[str, int] = {}
    for v in graph.inputs:
        if v.name in counted:
            size[root[v.name]] = max(size.get(root[v.name], 0), nbytes(v))
    owners: dict[str, int] = {}                      # storage -> number of live vars in it
    live_vars: set[str] = set()
    pinned = {o.name for o in graph.outputs if isinstance(o, Var)} | set(keep)
    last = last_uses(graph)

    def hold(name: str, r: str):
        owners[r] = owners.get(r, 0) + 1
        live_vars.add(name)

    cur = base
    followed = {root[n] for n in track if n in root} if track is not None else set()
    cur_t = 0                                        # bytes of the followed storages live
    for v in graph.inputs:
        if v.name in counted:
            r = root[v.name]
            if owners.get(r, 0) == 0:
                cur += size[r]
                cur_t += size[r] if r in followed else 0
            hold(v.name, r)
    start = cur
    tracked = [cur_t] if track is not None else None

    def release(name: str):
        nonlocal cur, cur_t
        if name not in live_vars or name in pinned:
            return
        live_vars.discard(name)
        r = root[name]
        owners[r] -= 1
        if owners[r] == 0 and r in size:
            freed = size.pop(r)
            cur -= freed
            cur_t -= freed if r in followed else 0

    after, during = [], []
    best, snapshot = -1, ()
    for i, e in enumerate(graph.eqns):
        made, outs, ins, scratch = _static(e, device)
        for name, new, nb in made:
            r = root[name]
            if new and name not in host:
                size[r] = nb
                cur += nb
                cur_t += nb if r in followed else 0
            if new or r in size:
                hold(name, r)
        during.append(cur + (scratch(e) if scratch is not None else 0))
        if tracked is not None:
            tracked.append(cur_t)
        if detail and during[-1] > best:
            best = during[-1]
            snapshot = tuple(sorted(size.items(), key=lambda kv: -kv[1]))
        for x in ins:
            if last.get(x) == i:
                release(x)
        for name in outs:
            # never read again (a recomputed op's other outputs, read before, if at all): freed at once, as
            # the lowered program drops a value after its last reader
            if last.get(name, -1) <= i:
                release(name)
        after.append(cur)
    if tracked is not None:
        tracked.append(cur_t)
    return Timeline(start, tuple(after), tuple(during), cur, snapshot, tuple(tracked or ()))


def _scratch_of(e: Eqn, device: str):
    """workspace(e, device) as a function of the equation (None: no scratch), resolved once per equation: the
    scratch itself is computed at each simulation, as it may read the thread count (ATen's CPU attention)."""
    f = WORKSPACE.get(e.op.name)
    if f is not None:
        return f
    f = _BY_DEVICE.get(e.op.name)
    if f is not None:
        return lambda e, f=f: f(e, device)
    return (WORKSPACE_BY_TARGET if device == "cpu" else _gpu_table(device)).get(e.op.target)


_STATIC = PerEqn(400_000)     # by equation and device: the planner simulates many programs made of the same equations


def _static(e: Eqn, device: str) -> tuple:
    """((output, a new storage, bytes) for each tensor output, output names, distinct input names, scratch)."""
    return _STATIC.get(e, _static_of, device)


def _static_of(e: Eqn, device: str) -> tuple:
    made = tuple((v.name, a is None, nbytes(v)) for v, a in zip(e.outputs, aliases(e)) if v.dtype is not None)
    return (made, tuple(v.name for v in e.outputs), tuple(dict.fromkeys(x.name for x in e.inputs)),
            _scratch_of(e, device))
