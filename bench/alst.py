"""ALST's recipe as DeepSpeed 0.19 ships it, on the hand-written Ulysses of bench/sp_vs_ulysses.py.

Arctic Long Sequence Training (arXiv 2506.13996; DeepSpeed's ALST tutorial) = Ulysses attention
(`DistributedAttention`) + HF per-layer checkpointing + `TiledMLP` around every decoder layer's MLP +
`TiledFusedLogitsLoss` for lm head and loss, so neither an MLP intermediate nor the logits of the
rank's whole sequence ever exist. The two tiled classes come from
`deepspeed.runtime.sequence_parallel.ulysses_sp`; nothing here patches HF globally: the MLPs are
tiled per instance, on the benchmark's own model copy.

Tile counts follow ALST's defaults:
  MLP   ceil(local s / hidden)            DeepSpeed's TiledMLP example and tutorial
  loss  ceil(fp32 local logits / slice)   ArcticTraining's SFT trainer, slice = 1 GiB on 80 GiB GPUs;
                                          the benchmarks scale the slice with the memory they model
"""
from __future__ import annotations

import math

import torch.nn.functional as F

from bench.sp_vs_ulysses import IGNORE, reduce_over_sp, ulysses_copy

# ArcticTraining's loss slice: about 1 GiB of fp32 logits per tile, on 80 GiB GPUs
SLICE_PER_MEMORY = 1 / 80


def mlp_tiles(seq: int, hidden: int) -> int:
    """TiledMLP's default shard count: tiles of at most `hidden` tokens."""
    return max(1, math.ceil(seq / hidden))


def loss_tiles(tokens: int, vocab: int, slice_bytes: float) -> int:
    """TiledFusedLogitsLoss's default shard count: fp32 logits of the rank's tokens / the slice."""
    return max(1, math.ceil(tokens * vocab * 4 / slice_bytes))


def _hf_mlp(mlp, x):
    # the model's own MLP forward (gate/up -> act -> multiply -> down), called on one tile
    return type(mlp).forward(mlp, x)


def alst_copy(model):
    """`model` (an HF Llama) rebuilt for ALST: the Ulysses attention function and per-layer
    checkpointing of `ulysses_copy`, and TiledMLP around every decoder layer's MLP. Call
    register_ulysses_attention first. The copy's `alst_tiles` records the tile counts last used."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    m = ulysses_copy(model, checkpointing=True)
    m.alst_tiles = {}

    for layer in m.model.layers:
        mlp = layer.mlp
        params = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]

        def tiled(x, mlp=mlp, params=params):
            # every rank holds s/P tokens, so the count agrees across ranks without the MAX all-reduce
            # the tutorial adds for ZeRO-3 with uneven lengths
            k = mlp_tiles(x.shape[-2], x.shape[-1])
            m.alst_tiles["mlp"] = k
            return TiledMLP.apply(_hf_mlp, mlp, x, k, params)

        mlp.forward = tiled                    # this instance only (nn.Module.__call__ reads it)
    return m


def alst_step(model, local_batch, group, slice_bytes: float):
    """One fwd+bwd of ALST: the decoder on this rank's tokens, then lm head + CE in tiles
    (TiledFusedLogitsLoss), local summed loss / global token count, grads summed over sp by hand
    (as `ulysses_step`). Returns the global loss. The caller frees the previous step's grads."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    ids_loc, pos_loc, lab_loc, n_tok = local_batch
    hidden = model.model(input_ids=ids_loc, position_ids=pos_loc, use_cache=False).last_hidden_state
    k = loss_tiles(lab_loc.numel(), model.config.vocab_size, slice_bytes)
    model.alst_tiles["loss"] = k

    def tile_loss(m, x, y):
        # x: (tokens of the tile, hidden), y: (tokens,). The tile's share of the global mean: the
        # 1 / n_tok sits inside, because TiledFusedLogitsLoss runs the tile's backward in its forward
        # with an incoming grad of 1, so lm_head's grads ignore any scale applied to its output.
        logits = m.lm_head(x).float()
        return F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum") / n_tok

    loss = TiledFusedLogitsLoss.apply(tile_loss, model, hidden, lab_loc, None, k, [model.lm_head.weight], "sum")
    loss.backward()
    return reduce_over_sp(model, loss, group)


def check_alst(alst, group, s: int, slice_bytes: float, fn, params, vocab: int) -> tuple[dict, dict]:
    """ALST's loss and grads against the single-device eager run of `fn` (HF's own loss) at length s:
    ({tensor: relative error on this rank}, tile counts used). At least 3 loss tiles, so the check
    runs the tiled path (uneven tiles, a prompt of ignored labels) even where the slice holds all.
    Grads are freed before and after."""
    import torch.distributed as dist

    from bench.sp_vs_ulysses import ulysses_batch
    from tests.models import batch, rank_errors, reference
    ids, labels = batch(1, s, vocab, seed=1)
    ref_loss, ref_grads = reference(fn, params, ids, labels)
    alst.zero_grad(set_to_none=True)
    local_logits = s // dist.get_world_size(group) * vocab * 4
    loss = alst_step(alst, ulysses_batch(ids, labels, group), group, min(slice_bytes, local_logits / 3))
    grads = {k: p.grad for k, p in alst.named_parameters()}
    errs = rank_errors(loss, grads, ref_loss, ref_grads)
    alst.zero_grad(set_to_none=True)
    return errs, dict(alst.alst_tiles)
