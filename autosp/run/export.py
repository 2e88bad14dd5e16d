"""`autosp export`: a run's checkpoint as a Hugging Face model folder.

    export("runs/extend", "runs/extend/hf")           # the newest checkpoint; step=N for another

The run folder holds the model's config.json as trained (its RoPE settings included) and its tokenizer's files
(autosp train writes them with the first metrics); a checkpoint holds the parameters as the ranks that wrote it
laid them out (shards of any world size, fp32 master weights in mixed precision or with --optimizer-offload).
torch.distributed.checkpoint reads them back whole, in this one process (`no_dist`: its own resharding), into
the model transformers builds from the config; `save_pretrained` writes config.json and safetensors in shards,
and the tokenizer's files are copied beside them. `AutoModelForCausalLM.from_pretrained` loads the folder.

The written config.json is read back and held to the run's RoPE settings (`check_rope`): a config that names
none (no rope_parameters, rope_theta or rope_scaling) is compared as "no RoPE", never as the defaults a reader
would assume, so the check cannot pass by both sides guessing the same.
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
    cfg = AutoConfig.from_pretrained(run, local_files_only=True)
    if any(x is not None for x in rope):
        from autosp.run.models import set_rope
        if rope_entry(cfg) is None:             # set_rope would add settings the model never reads
            raise AutospError(f"{run}: its config.json ({cfg.model_type}) names no RoPE settings (no rope_parameters, "
                              "rope_theta or rope_scaling), so --rope-theta and --rope-scaling would change nothing. "
                              "Fix: leave them out, or pass a run of a model with rotary positions.")
        set_rope(cfg, *rope)
    found = dict(checkpoints(run))
    if not found:
        raise AutospError(f"{run}: no complete checkpoint (step-N with its .metadata). Fix: train until a checkpoint "
                          "is saved (--save-every, and always at the end).")
    if step is None:
        step = max(found)
    if step not in found:
        raise AutospError(f"{run}: no checkpoint step-{step} (it has {', '.join(f'step-{s}' for s in sorted(found))})."
                          f" Fix: --step {max(found)}.")
    from autosp.run.lora import rebuild, run_lora
    lora = run_lora(run)
    if lora is not None:                        # the adapters, on the base rebuilt as the run built it: merged
        return rebuild(run, cfg, lora, found[step]).merge_and_unload(), found[step]
    from autosp.run.models import with_attention
    model = with_attention(AutoModelForCausalLM.from_config, cfg, dtype=torch.float32)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():            # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=found[step], no_dist=True)
    model.load_state_dict(state["model"])
    return model.eval(), found[step]


def rope_entry(cfg) -> dict | None:
    """The RoPE settings a config names (models.rope_of), or None where it names none: rope_of would answer with
    defaults for a model whose positions are not rotary at all (GPT-2's are learned)."""
    from autosp.run.models import rope_of
    if all(getattr(cfg, key, None) is None for key in ("rope_parameters", "rope_theta", "rope_scaling")):
        return None
    return rope_of(cfg)


def check_rope(run: str, out: str) -> dict | None:
    """The RoPE settings the run trained with (its config.json), once the folder `out` is known to carry the same,
    with the same max_position_embeddings; an AutospError otherwise. None: neither names RoPE, checked as such."""
    from transformers import AutoConfig
    trained, written = (AutoConfig.from_pretrained(f, local_files_only=True) for f in (run, out))
    want, got = rope_entry(trained), rope_entry(written)
    positions = [getattr(c, "max_position_embeddings", None) for c in (trained, written)]
    if want != got or positions[0] != positions[1]:
        def say(entry, n):
            return f"{'no RoPE settings' if entry is None else entry} with max_position_embeddings {n}"
        raise AutospError(f"export {run} -> {out}: the run trained with {say(want, positions[0])}, the exported "
                          f"config.json says {say(got, positions[1])}, so the folder would run other positions. "
                          f"Fix: copy the run's config.json over {os.path.join(out, 'config.json')} (transformers "
                          "wrote back other settings than it read).")
    return want


def export(run: str, out: str, *, step: int | None = None, shard_size: str = "2GB", merge: bool = False) -> str:
    """Write the run's checkpoint (`step`, default the newest) to `out` as a Hugging Face folder; returns the
    checkpoint it read. A LoRA run (run/lora.py): its adapter folder (peft.PeftModel.from_pretrained(base, out)
    loads it), or with `merge` the base with the adapters merged, a whole Hugging Face folder."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise AutospError(f"--out {out} exists and is not an empty folder. Fix: another --out, or remove it.")
    from autosp.run.lora import export_adapters, run_lora
    if run_lora(run) is None and merge:
        raise AutospError(f"--merge: {run} trained every parameter, no LoRA adapters, so there is nothing to merge. "
                          "Fix: leave out --merge (the export is the whole model already).")
    if run_lora(run) is not None and not merge:
        path = export_adapters(run, out, step)
        _copy_tokenizer(run, out)
        return path
    model, path = load_run(run, step)
    model.save_pretrained(out, max_shard_size=shard_size, safe_serialization=True)
    check_rope(run, out)
    _copy_tokenizer(run, out)
    return path


def _copy_tokenizer(run: str, out: str) -> None:
    tokenizer = os.path.join(run, "tokenizer")
    if os.path.isdir(tokenizer):
        for name in os.listdir(tokenizer):
            shutil.copy(os.path.join(tokenizer, name), os.path.join(out, name))
