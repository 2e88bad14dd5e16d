"""`autosp export`: a run's checkpoint as a Hugging Face model folder.

    export("runs/extend", "runs/extend/hf")           # the newest checkpoint; step=N for another

The run folder holds the model's config.json as trained (its RoPE settings included) and its tokenizer's files
(autosp train writes them with the first metrics); a checkpoint holds the parameters as the ranks that wrote it
laid them out (shards of any world size, fp32 master weights in mixed precision or with --optimizer-offload).
torch.distributed.checkpoint reads them back whole, in this one process (`no_dist`: its own resharding), into
the model transformers builds from the config; `save_pretrained` writes config.json and safetensors in shards,
and the tokenizer's files are copied beside them. `AutoModelForCausalLM.from_pretrained` loads the folder.
"""
from __future__ import annotations

import os
import shutil
import warnings

from autosp.errors import AutospError


def load_run(run: str, step: int | None = None, rope: tuple = (None, None)):
    """(the model of a run's checkpoint, in fp32 on the CPU, and that checkpoint's path); `rope`: (theta, scaling)
    to set on its config before the model is built (models.set_rope), e.g. to evaluate beyond its trained length."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    from autosp.run.checkpoint import checkpoints
    config = os.path.join(run, "config.json")
    if not os.path.isfile(config):
        raise AutospError(f"{run}: no config.json, so not a run folder autosp train wrote (it writes config.json with "
                          "its first metrics). Fix: pass the --out folder of an autosp train run.")
    found = dict(checkpoints(run))
    if not found:
        raise AutospError(f"{run}: no complete checkpoint (step-N with its .metadata). Fix: train until a checkpoint "
                          "is saved (--save-every, and always at the end).")
    if step is None:
        step = max(found)
    if step not in found:
        raise AutospError(f"{run}: no checkpoint step-{step} (it has {', '.join(f'step-{s}' for s in sorted(found))})."
                          f" Fix: --step {max(found)}.")
    cfg = AutoConfig.from_pretrained(run, local_files_only=True)
    if any(x is not None for x in rope):
        from autosp.run.models import set_rope
        set_rope(cfg, *rope)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():            # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=found[step], no_dist=True)
    model.load_state_dict(state["model"])
    return model.eval(), found[step]


def export(run: str, out: str, *, step: int | None = None, shard_size: str = "2GB") -> str:
    """Write the run's checkpoint (`step`, default the newest) to `out` as a Hugging Face folder; returns the
    checkpoint it read."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise AutospError(f"--out {out} exists and is not an empty folder. Fix: another --out, or remove it.")
    model, path = load_run(run, step)
    model.save_pretrained(out, max_shard_size=shard_size, safe_serialization=True)
    tokenizer = os.path.join(run, "tokenizer")
    if os.path.isdir(tokenizer):
        for name in os.listdir(tokenizer):
            shutil.copy(os.path.join(tokenizer, name), os.path.join(out, name))
    return path
