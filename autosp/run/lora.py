"""LoRA through peft: the adapters train, the base model is a frozen input of the step.

    model = apply(build_model(spec), step.lora)       # peft.get_peft_model; returns the peft model's inner model
    adapters, base = split(model)                      # by requires_grad: what trains, what does not
    loss = step_loss(model, adapters, base, ids, labels, pos)

`autosp.value_and_grad` differentiates its first argument: the base is a later argument, its nn.Parameters without
requires_grad, so autosp traces them as frozen parameters (Role.FROZEN: not differentiated, and not the batch) and
the backward neither computes their gradients nor keeps the activations only those gradients need. The base is kept in the compute dtype (bf16 with --precision bf16; sharded over the ranks as
autosp.shard_params lays it out, or whole with --no-shard-params), with no gradient and no optimizer state; the
adapters are fp32 masters that AdamW steps. `Lora` is the Step's part (config.py's --lora-* flags); the planner
(plan.Tracer) traces the same step on meta tensors, and answer.model_state counts the state this module
describes: the base in the compute dtype, the adapters' fp32 master, gradient and moments.

A run's checkpoints hold the adapters and their optimizer state only; the base is rebuilt from the model folder's
weights or from --seed (the run record says which: `record`), for --resume, `autosp eval` and `autosp export`
(`rebuild`: the PeftModel, whose save_pretrained writes the folder `peft.PeftModel.from_pretrained(base, folder)`
loads, and whose merge_and_unload is the whole model export.py writes with --merge).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from autosp.errors import AutospError
from autosp.units import fmt_bytes as fmt


@dataclass(frozen=True)
class Lora:
    """The adapters a Step trains: rank, scale (alpha / r scales their product), dropout on their input, and the
    names of the Linear modules they wrap (None: every Linear of the model but its output head, `targets`)."""
    r: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None

    def describe(self) -> str:
        return (f"LoRA r {self.r}, alpha {self.alpha:g}, dropout {self.dropout:g} on "
                + ("the model's Linear projections" if self.targets is None else ", ".join(self.targets)))


def targets(model) -> list[str]:
    """The default targets: the names of every nn.Linear of the model but its output head (the attention and MLP
    projections of a transformer: q, k, v, o, gate, up, down in a Llama), read from the model, not from a list per
    family."""
    import torch
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            short = name.rsplit(".", 1)[-1]
            if short not in names:
                names.append(short)
    return names


def wanted(model, lora: Lora) -> list[str]:
    """The Linear modules `lora` adapts in `model`; an AutospError naming the ones it has where a target is none."""
    names = list(lora.targets) if lora.targets is not None else targets(model)
    have = targets(model)
    missing = [t for t in names if t not in have]
    if missing or not names:
        raise AutospError(f"--lora-targets {','.join(names) or '(none)'}: {', '.join(missing) or 'nothing'} names no "
                          f"Linear module of {type(model).__name__}. Fix: --lora-targets from {','.join(have)} (or "
                          "leave it out: all of them).")
    return names


def check_targets(step) -> None:
    """`wanted` on the step's model built on the meta device: the launcher refuses bad --lora-targets before any
    rank starts."""
    from autosp.run.models import build_model, spec_of
    wanted(build_model(spec_of(step), device="meta"), step.lora)


def wrap(model, lora: Lora):
    """peft.get_peft_model with peft's LoRA adapters on `lora.targets` (the PeftModel); its base parameters have
    requires_grad off."""
    from peft import LoraConfig, get_peft_model
    wanted_ = wanted(model, lora)
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=wanted_,
                     bias="none", task_type="CAUSAL_LM")
    import warnings
    with warnings.catch_warnings():             # peft 0.21 asks transformers 5 a deprecated question once per model
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        # on the meta device (the planner's model) the adapters are made there too: initialising them on the CPU
        # takes seconds for an 8B model, and its OpenMP threads then hang the planner's forked process
        meta = next(model.parameters()).device.type == "meta"
        return get_peft_model(model, cfg, low_cpu_mem_usage=meta)


def apply(model, lora: Lora):
    """wrap's inner model: the causal LM with its Linear layers wrapped, whose parameters the step takes by name
    (the names a checkpoint holds)."""
    return wrap(model, lora).get_base_model()


def split(model) -> tuple[dict, dict]:
    """(adapters, base): the model's parameters by name, those that train and those that do not."""
    params = dict(model.named_parameters())
    return ({k: p for k, p in params.items() if p.requires_grad},
            {k: p for k, p in params.items() if not p.requires_grad})


def freeze_dtype(model, dtype) -> None:
    """The frozen base in `dtype`, in place (the compute dtype: it has no fp32 master to keep, nothing updates it);
    a weight shared by two modules stays shared."""
    import torch
    done = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.requires_grad or p.dtype == dtype:
                continue
            if id(p) not in done:
                done[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
            module._parameters[name] = done[id(p)]


def step_loss(model, adapters, base, input_ids, labels, position_ids=None):
    """The LoRA step's loss: the model's loss with the adapters and the frozen base as two arguments (only the
    first is differentiated)."""
    from autosp.run.plan import step_loss as full
    return full(model, {**base, **adapters}, input_ids, labels, position_ids)


class Bound:
    """value_and_grad's LoRA step with the frozen base bound as its second argument: called, planned and evaluated
    (`.sharded`) with the adapters alone, as train.py calls the full fine-tuning step with the parameters."""

    def __init__(self, step_fn, base: dict):
        self.step_fn, self.base = step_fn, base
        self.sharded = _BoundSharded(step_fn.sharded, base)

    def __call__(self, adapters, *rest):
        return self.step_fn(adapters, self.base, *rest)

    def plan(self, adapters, *rest):
        return self.step_fn.plan(adapters, self.base, *rest)


class _BoundSharded:
    """autosp.shard's forward of the LoRA step, the base bound (train.evaluate's loss on held-out data)."""

    def __init__(self, sharded, base: dict):
        self.inner, self.base = sharded, base

    def __call__(self, adapters, *rest):
        return self.inner(adapters, self.base, *rest)

    def compile_report(self):
        return self.inner.compile_report()


def adapter_bytes(model, ranks: int, sharded: bool) -> int:
    """The fp32 bytes of one rank's adapters, the fullest rank's where they are sharded (plan.master_bytes's split):
    what their master, gradient and each moment take."""
    from autosp.run.plan import fullest_shard
    return sum((fullest_shard(p, ranks) if sharded else p.numel()) * 4 for p in model.parameters() if p.requires_grad)


def own_adapter_bytes(model) -> int:
    """The fp32 bytes of the adapters this rank holds (its local shards)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters()
               if p.requires_grad)


def state_line(st, dtype: str, dp: int, sp: int) -> str:
    """`autosp plan`'s line on a LoRA step's model state."""
    base = st.params - st.grads             # the adapters are kept as their gradients are: fp32 masters
    where = (f"sharded over {st.ranks} ranks (dp {dp} x sp {sp}, Shard(0) as FSDP2 lays it out)" if st.ranks > 1 else
             "whole on every rank" if dp * sp > 1 else "whole")
    return (f"model state per rank (LoRA, {where}): the frozen base in {dtype} {fmt(base)} (no gradient, no optimizer "
            f"state), the adapters' fp32 master {fmt(st.params - base)}, their gradients {fmt(st.grads)} (counted in "
            f"the step's peak) and optimizer moments {fmt(st.moments)} = {fmt(st.total)}")


def banner(lora: Lora, model, base: dict, world: int, sharded: bool, sp: int) -> str:
    """The train banner's line on LoRA: what trains, what is frozen and where it lives, and what dropout draws."""
    n_adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in base.values())
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in base.values()})
    where = f"sharded over {world} ranks" if sharded and world > 1 else "whole on every rank" if world > 1 else "whole"
    line = (f"  {lora.describe()}: {n_adapters / 1e6:.3f}M adapter parameters train (fp32 masters, AdamW), the "
            f"{n_base / 1e6:.2f}M of the base are frozen in {'/'.join(dtypes)}, {where}: {fmt(local)} per rank, no "
            "gradient and no optimizer state")
    if lora.dropout and sp > 1:
        line += (f"\n  --lora-dropout {lora.dropout:g} under sp {sp}: each rank draws the masks of its own positions, "
                 "so the run draws other masks than one device would (the same distribution, not the same numbers)")
    return line


# ---------------------------------------------------------------- runs: the record, checkpoints, export

def record(lora: Lora, model, spec, seed: int, device: str) -> dict:
    """What the run record (autosp.json) says of a LoRA run: the adapters, and how the base is rebuilt (the
    checkpoints hold the adapters only)."""
    wrapped = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")})
    frozen = next((p.dtype for p in model.parameters() if not p.requires_grad), None)
    return {"lora": {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "targets": wrapped,
                     "base_dtype": str(frozen).replace("torch.", ""),
                     "base": (f"the weights of {spec.weights}" if spec.weights else
                              f"random init from --seed {seed} on {device}"),
                     "weights": spec.weights, "seed": seed, "device": device}}


def run_lora(run: str) -> dict | None:
    """The run record's LoRA entry (record), or None for a run that trained every parameter."""
    from autosp.run.inputs import RUN_RECORD
    try:
        with open(os.path.join(run, RUN_RECORD)) as f:
            return json.load(f).get("lora")
    except (OSError, ValueError):
        return None


def rebuild(run: str, cfg, entry: dict, checkpoint: str):
    """A LoRA run's model from its record and a checkpoint: the base rebuilt as the run built it, the adapters
    read from the checkpoint; fp32 on the CPU. Returns the PeftModel."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from autosp.run.models import ModelSpec, build_model, with_attention
    if entry.get("weights"):
        if not os.path.isdir(entry["weights"]):
            raise AutospError(f"{run}: a LoRA run whose base is {entry['base']}, which is gone. Fix: put the model "
                              f"folder back at {entry['weights']} (the checkpoints hold the adapters only).")
        base = with_attention(AutoModelForCausalLM.from_pretrained, entry["weights"], config=cfg,
                              local_files_only=True, dtype=torch.float32)
    else:
        device = entry.get("device", "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise AutospError(f"{run}: a LoRA run whose base is {entry['base']}: its random init is drawn on a GPU, "
                              "and none is visible. Fix: export on a machine with a GPU (the checkpoints hold the "
                              "adapters only), or train LoRA on a model folder's weights.")
        base = build_model(ModelSpec(run, cfg, None), seed=int(entry["seed"]), device=device).float().cpu()
    kept = getattr(torch, entry.get("base_dtype", "float32"))
    if kept != torch.float32:                   # the base the run computed with: rounded to the dtype it kept
        base = base.to(kept).float()
    wrapped = wrap(base, Lora(int(entry["r"]), float(entry["alpha"]), float(entry["dropout"]),
                              tuple(entry["targets"])))
    model = wrapped.get_base_model()
    adapters, _ = split(model)
    state = {"model": {k: v.detach() for k, v in adapters.items()}}
    with warnings.catch_warnings():            # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    model.load_state_dict(state["model"], strict=False)
    return wrapped.eval()


def export_adapters(run: str, out: str, step: int | None = None) -> str:
    """Write a LoRA run's adapters (checkpoint `step`, default the newest) to `out` as peft's adapter folder
    (adapter_config.json, adapter_model.safetensors); returns the checkpoint it read. The config names the base
    model folder where the run trained on one (base_model_name_or_path)."""
    from transformers import AutoConfig

    from autosp.run.checkpoint import checkpoints
    entry = run_lora(run)
    found = dict(checkpoints(run))
    if not found:
        raise AutospError(f"{run}: no complete checkpoint (step-N with its .metadata). Fix: train until a checkpoint "
                          "is saved (--save-every, and always at the end).")
    step = max(found) if step is None else step
    if step not in found:
        raise AutospError(f"{run}: no checkpoint step-{step} (it has {', '.join(f'step-{s}' for s in sorted(found))})."
                          f" Fix: --step {max(found)}.")
    cfg = AutoConfig.from_pretrained(run, local_files_only=True)
    model = rebuild(run, cfg, entry, found[step])
    if entry.get("weights"):
        model.peft_config["default"].base_model_name_or_path = os.path.abspath(entry["weights"])
    model.save_pretrained(out)
    return found[step]
