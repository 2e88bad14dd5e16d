"""transformers' Trainer (and TRL's SFTTrainer and DPOTrainer), sequence-parallel through one argument.

    from autosp.integrations.transformers import AutospTrainer      # was: from transformers import Trainer
    trainer = AutospTrainer(model=model, args=args, train_dataset=ds, sp=2)   # was: Trainer(...)
    trainer.train()                          # torchrun --nproc-per-node 4 train.py: dp 2 x sp 2

`sp` is the sequence-parallel degree, as DeepSpeed-Ulysses' `sequence_parallel_size` and torchtitan's
`context_parallel_degree` are: the one number a user of either sets. It goes to the trainer rather than into
TrainingArguments, so the script's own arguments (HfArgumentParser, a YAML file) stay as they are; the ranks
torchrun starts form a (dp, sp) mesh, dp = world / sp.

What changes against the Trainer it extends, each through an overridden hook (no patching):
- `_wrap_model`: training runs `autosp.compile` of the model's own loss (`model(**batch).loss`, labels shifted
  as the model shifts them) instead of accelerate's DDP wrap; each rank holds s/P of each activation, and the
  gradients autosp gives are complete on every sp rank and averaged over dp, so nothing reduces them again.
- `get_train_dataloader`: batches sharded over the dp ranks only (every sp rank of a dp group gets the same
  rows, as `autosp train` shards them); `per_device_train_batch_size` is rows per dp group.
- `compute_loss`: the loss each rank logs is the global one (the mean over the labelled tokens of every dp
  rank's batch with `average_tokens_across_devices`, the Trainer's default), the same on every rank.
- `bf16=True`: the model's forward runs under bf16 autocast, where accelerate's prepare (skipped for the model
  `_wrap_model` returns) would have put it; autosp writes autocast's casts into the step (trace.explicit_autocast).
Gradient accumulation, clipping, the optimizer and scheduler, logging and saving are the Trainer's own.
- evaluation (`prediction_step`, `get_eval_dataloader`): the eval loss is sequence-parallel as training's is (the
  step's own module in eval mode, no gradient; rows sharded over dp). With compute_metrics, which reads the whole
  logits, the plain model runs on each rank's own rows instead.
TRL: AutospSFTTrainer (the model's loss, as SFTTrainer's default loss_type 'nll' is), AutospDPOTrainer
(autosp/integrations/dpo.py: TRL's sigmoid DPO loss over the policy and the reference model); made from TRL's
classes on first use, so this module imports without TRL. `with_autosp(cls)` does the same for a subclass of
yours, and refuses one with its own compute_loss (autosp would compute another loss in its place).

Each new batch shape compiles once (trace + sharding pass): pad the batches to a fixed length (a collator's
`pad_to_multiple_of`, or `padding="max_length"`) so the step compiles once.
"""
from __future__ import annotations

import os

import torch

from autosp.errors import AutospError

try:
    from transformers import Trainer
except ImportError as exc:                  # the library itself never needs transformers
    raise ImportError(f"autosp.integrations.transformers needs transformers and accelerate ({exc}). "
                      "Fix: pip install 'autosp[train]'.") from None


class _CausalLMLoss(torch.nn.Module):
    """The single-device code autosp shards: the wrapped model's own loss on a batch of keyword tensors."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **batch):
        out = self.model(**batch)
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is None:
            raise AutospError(
                f"{type(self.model).__name__}(**batch) returned no loss for the keys {sorted(batch)}; autosp shards "
                "the model's own loss. Fix: a model that computes its loss from `labels` (a ...ForCausalLM), or a "
                "collator that passes them.")
        return loss


class _Autocast(torch.nn.Module):
    """`model` under autocast, as accelerate's prepare wraps a model's forward for bf16=True. autosp traces the
    region and writes autocast's casts into the program it shards (autosp.trace.explicit_autocast)."""

    def __init__(self, model: torch.nn.Module, device_type: str, dtype: torch.dtype):
        super().__init__()
        self.model, self.device_type, self.dtype = model, device_type, dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.model(*args, **kwargs)


class AutospTrainerMixin:
    """The sequence-parallel half of AutospTrainer, for any Trainer subclass (`with_autosp(cls)`).

    sp: the sequence-parallel degree (must divide the world torchrun starts); memory_budget: autosp.shard's
    remat budget for the step (None: save what autograd saves)."""

    _sharded_losses = ("Trainer", "SFTTrainer")

    def __init__(self, *args, sp: int | None = None, memory_budget=None, **kwargs):
        if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
            raise AutospError(f"{type(self).__name__}(sp={sp!r}): sp is the number of ranks each sequence is "
                              "split over, an int >= 1. Fix: sp=2 (and launch with torchrun --nproc-per-node 2).")
        self.sp, self.memory_budget, self._eval_sharded = sp, memory_budget, None
        own = _own_loss(type(self), self._sharded_losses)
        if own is not None:                         # before its __init__ runs: nothing built for nothing
            raise AutospError(
                f"{type(self).__name__}(sp={sp}): {own.__name__}.compute_loss ({own.__module__}) computes its own "
                f"loss, and autosp shards the model's own loss (model(**batch).loss) in its place. Fix: compute the "
                "loss in the model's forward (from `labels`), or shard your loss function with "
                "autosp.shard(loss_fn, mesh) in your own loop.")
        super().__init__(*args, **kwargs)
        self._check_setup()
        world = self.args.world_size
        self.dp = world // sp
        self.dp_rank = self.args.process_index // sp   # the mesh is (dp, sp), row-major over global ranks
        self.mesh = _mesh(self.args.device.type, self.dp, sp) if world > 1 else None

    def _check_setup(self) -> None:
        name, args, world = type(self).__name__, self.args, self.args.world_size
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != world:
            raise AutospError(
                f"{name}(sp={self.sp}): torchrun started {launched} ranks, and TrainingArguments sees {world} "
                f"(device {args.device}); on a machine without a GPU accelerate trains distributed only with "
                "use_cpu=True. Fix: TrainingArguments(..., use_cpu=True) on CPU.")
        if world % self.sp:
            raise AutospError(
                f"{name}(sp={self.sp}): the world has {world} rank{'s' if world != 1 else ''}, which sp={self.sp} "
                f"does not divide (the ranks form a dp x sp mesh). Fix: launch a multiple of {self.sp} ranks "
                f"(torchrun --nproc-per-node {self.sp * max(1, world // self.sp)} ...), or pass an sp that "
                f"divides {world}.")
        pc = getattr(args, "parallelism_config", None)
        if pc is not None and (getattr(pc, "sp_enabled", False) or getattr(pc, "cp_enabled", False)):
            raise AutospError(
                f"{name}(sp={self.sp}): TrainingArguments.parallelism_config already splits the sequence "
                f"(sp_size={getattr(pc, 'sp_size', 1)}, cp_size={getattr(pc, 'cp_size', 1)}); two sequence-parallel "
                "schemes cannot share a step. Fix: drop parallelism_config and keep sp=..., or drop sp.")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            which = "DeepSpeed" if self.is_deepspeed_enabled else "FSDP"
            raise AutospError(
                f"{name}(sp={self.sp}): {which} is enabled in TrainingArguments; it wraps the model and reduces "
                "its gradients itself, while autosp's gradients are already complete on every rank. Fix: drop "
                f"the {which} arguments (autosp shards the activations; each rank keeps the whole model), or "
                "shard the model state with `autosp train` instead.")
        if args.fp16:
            raise AutospError(
                f"{name}(sp={self.sp}): fp16=True scales the loss by accelerate's GradScaler, which autosp's step "
                "is not checked with. Fix: bf16=True (autocast to bfloat16, no scaler), or fp32.")
        self._check_loss()
        if self.compute_loss_func is not None or self.label_smoother is not None:
            raise AutospError(
                f"{name}(sp={self.sp}): compute_loss_func / label_smoothing_factor need the whole logits, which "
                "no rank holds under sequence parallelism. Fix: drop them (the model's own loss is sharded), or "
                "write the loss into the model's forward.")

    def _check_loss(self) -> None:
        args = self.args
        if getattr(args, "loss_type", "nll") not in ("nll", None) or getattr(self, "aux_loss_enabled", False):
            raise AutospError(
                f"{type(self).__name__}(sp={self.sp}): loss_type={args.loss_type!r} (or a MoE auxiliary loss) is "
                "TRL's own loss, not the model's; autosp shards the model's own loss. Fix: loss_type='nll' "
                "(SFTConfig's default).")

    # ------------------------------------------------------------------ the model
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        from autosp.api import ShardedModule
        if not training or self.mesh is None:
            return super()._wrap_model(model, training, dataloader)
        if isinstance(model, ShardedModule):          # train() again: already wrapped
            return model
        import autosp
        import torch.distributed as dist
        # as DDP does when it wraps a model: every rank starts from rank 0's parameters and buffers
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
        # not accelerate.prepare's DDP: autosp's gradients are complete on every rank already (the Trainer
        # skips prepare for a model _wrap_model changed)
        return autosp.compile(self._loss_module(self._autocast(model)), self.mesh, memory_budget=self.memory_budget)

    def _autocast(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as the Trainer would run it: under bf16 autocast with bf16=True (accelerate's prepare, which
        the trainer skips for the model _wrap_model returns, puts it there otherwise)."""
        if not self.args.bf16:
            return model
        return _Autocast(model, self.args.device.type, torch.bfloat16)

    def _loss_module(self, model) -> torch.nn.Module:
        """The single-device code autosp shards: a module over `model` whose forward(**batch) is the loss."""
        return _CausalLMLoss(model)

    def _loss_batch(self, inputs: dict, num_items_in_batch) -> tuple[dict, int]:
        """(the keyword tensors _loss_module's forward takes, the factor its loss is scaled by)."""
        batch = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        if "labels" not in batch:
            raise AutospError(f"{type(self).__name__}: the batch has no 'labels' (keys {sorted(inputs)}); autosp "
                              "shards the model's own loss, which needs them. Fix: a collator that sets labels, such "
                              "as DataCollatorForLanguageModeling(tokenizer, mlm=False).")
        scale = 1
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            # a tensor, not an int: a number would be a constant of the trace, compiled again every step
            batch["num_items_in_batch"] = torch.as_tensor(num_items_in_batch, device=batch["labels"].device)
            if self.args.average_tokens_across_devices:
                scale = self.dp     # autosp averages over dp the dp ranks' sums over the global count
        return batch, scale

    def _logged(self, out, mode: str = "train"):
        """The loss from what _loss_module's forward returned (a subclass records metrics from the rest under
        `mode`, 'train' or 'eval')."""
        return out

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        from autosp.api import ShardedModule
        if not isinstance(model, ShardedModule) or not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        name = type(self).__name__
        if return_outputs:
            raise AutospError(f"{name}.compute_loss(return_outputs=True) while training: under sequence "
                              "parallelism the step computes the loss only (no rank holds the whole logits). "
                              "Fix: ask for the loss alone.")
        batch, scale = self._loss_batch(inputs, num_items_in_batch)
        try:
            loss = self._logged(model(**batch))
        except AutospError as exc:
            # the first call compiles: autosp's own message (the op, the line, the fix), with the trainer's context
            raise type(exc)(f"{name}(sp={self.sp}): autosp cannot compile the training step of "
                            f"{type(self.model).__name__} on {_shapes(batch)}:\n{exc}") from None
        return loss * scale if scale != 1 else loss

    # ------------------------------------------------------------------ evaluation
    def _sp_eval(self) -> bool:
        """Whether evaluation is sequence-parallel: the loss only, as training computes it. compute_metrics reads
        the whole logits, which no rank holds under sp: then the plain model runs on each rank's own rows."""
        return self.mesh is not None and (self.compute_metrics is None or self.args.prediction_loss_only)

    def get_eval_dataloader(self, eval_dataset=None):
        loader = super().get_eval_dataloader(eval_dataset)
        if self._sp_eval():
            _shard_over_dp(loader, self.dp, self.dp_rank, type(self).__name__)
        return loader

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The eval loss of the global batch, the dp groups' rows sharded over their sp ranks (no gradient): the
        same on every rank, so the eval loop's gather and its trim of a padded last batch keep it as it is."""
        if not (prediction_loss_only and self._sp_eval()):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        inputs = self._prepare_inputs(inputs)
        count = self._per_group(self._get_num_items_in_batch([inputs], self.args.device))
        sharded = self._eval_module().eval()     # as the eval loop left the model (training_step sets it back)
        batch, scale = self._loss_batch(inputs, count)
        with torch.no_grad():
            loss = self._logged(sharded(**batch), "eval")
        return (loss * scale).detach(), None, None

    def _eval_module(self):
        """The step autosp compiled for training (the same module; in eval mode its own program), or, before any
        training, one made as _wrap_model makes it."""
        from autosp.api import ShardedModule
        if isinstance(self.model_wrapped, ShardedModule):
            return self.model_wrapped
        if self._eval_sharded is None:
            self._eval_sharded = self._wrap_model(self.model, training=True)
        return self._eval_sharded

    # ------------------------------------------------------------------ the data
    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        if self.mesh is not None:
            _shard_over_dp(loader, self.dp, self.dp_rank, type(self).__name__)
        return loader

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * (args.world_size // self.sp)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        return batches, self._per_group(count)

    def _per_group(self, count):
        """The Trainer's count of labelled tokens, gathered over the world with average_tokens_across_devices: each
        dp group's batch is counted once on each of its sp ranks, so it is sp times the global count."""
        if count is not None and self.args.average_tokens_across_devices and self.args.world_size > 1:
            return count / self.sp
        return count

    def _track_num_input_tokens(self, inputs):
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.sp


def _own_loss(cls: type, sharded: tuple[str, ...]):
    """The class whose compute_loss `cls` would run instead of the loss the mixin shards, or None. `sharded`: the
    trainers (transformers' or TRL's) whose loss the mixin computes as they do: Trainer's is the model's loss,
    SFTTrainer's too for its default loss_type 'nll' (checked with its arguments), DPOTrainer's is dpo.DPOLoss."""
    for klass in cls.__mro__:
        if "compute_loss" not in vars(klass) or issubclass(klass, AutospTrainerMixin):
            continue
        if klass.__name__ in sharded and klass.__module__.split(".")[0] in ("transformers", "trl"):
            return None
        return klass
    return None


def _shapes(batch: dict) -> str:
    return ", ".join(f"{k} {list(v.shape)}" for k, v in batch.items())


def _mesh(device: str, dp: int, sp: int):
    from torch.distributed.device_mesh import init_device_mesh
    if dp == 1:
        return init_device_mesh(device, (sp,), mesh_dim_names=("sp",))
    return init_device_mesh(device, (dp, sp), mesh_dim_names=("dp", "sp"))


def _shard_over_dp(loader, dp: int, dp_rank: int, name: str) -> None:
    """Point the shard accelerate made for this rank of the world at its dp rank instead: the sp ranks of a dp
    group then read the same batches (the same sampler, seeded alike), the dp ranks different ones. transformers
    re-targets the same object for its BatchRebalanceSampler; the shard reads both fields at each iteration."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
    shard = getattr(loader, "batch_sampler", None)
    if isinstance(loader, DataLoaderDispatcher):
        shard = None
    elif not isinstance(shard, BatchSamplerShard):
        shard = getattr(loader, "dataset", None)
        shard = shard if isinstance(shard, IterableDatasetShard) else None
    if shard is None:
        raise AutospError(
            f"{name}: the training DataLoader ({type(loader).__name__} over {type(loader.dataset).__name__}) is not "
            "one whose rows can be sharded over the dp ranks only (an iterable dataset dispatched from rank 0, or "
            "one sharded by the datasets library). Fix: a map-style dataset (datasets.Dataset, a list), or "
            "TrainingArguments(accelerator_config={'dispatch_batches': False}) with an iterable one.")
    shard.num_processes, shard.process_index = dp, dp_rank


class AutospTrainer(AutospTrainerMixin, Trainer):
    """transformers.Trainer, sequence-parallel: AutospTrainer(model=..., args=..., train_dataset=..., sp=2)."""


def __getattr__(name: str):
    """TRL's trainers, made on first use, so that this module imports without TRL."""
    if name not in _TRL:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import trl
    except ImportError as exc:
        raise AutospError(f"autosp.integrations.transformers.{name} extends TRL's {_TRL[name]}, and TRL is not "
                          f"installed ({exc}). Fix: pip install trl, or use AutospTrainer.") from None
    cls = globals()[name] = with_autosp(getattr(trl, _TRL[name]))
    return cls


_TRL = {"AutospSFTTrainer": "SFTTrainer", "AutospDPOTrainer": "DPOTrainer"}


def with_autosp(trainer_cls: type) -> type:
    """`trainer_cls` (a Trainer subclass: yours, or TRL's) with autosp's sequence parallelism: the class takes
    `sp=` (and `memory_budget=`) besides its own arguments."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise AutospError(f"with_autosp({trainer_cls!r}): expected a subclass of transformers.Trainer. Fix: "
                          "with_autosp(MyTrainer) where MyTrainer extends Trainer (or one of TRL's trainers).")
    if issubclass(trainer_cls, AutospTrainerMixin):
        return trainer_cls
    mixin = AutospTrainerMixin
    if any(k.__name__ == "DPOTrainer" and k.__module__.startswith("trl.") for k in trainer_cls.__mro__):
        from autosp.integrations.dpo import AutospDPOMixin as mixin     # TRL's DPO loss, sharded
    return type(f"Autosp{trainer_cls.__name__}", (mixin, trainer_cls),
                {"__doc__": f"{trainer_cls.__name__}, sequence-parallel through autosp (sp=...).",
                 "__module__": __name__})
