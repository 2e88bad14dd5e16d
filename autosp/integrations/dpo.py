"""TRL's DPOTrainer, sequence-parallel: `AutospDPOTrainer(model=..., ref_model=..., args=DPOConfig(...), sp=2)`
(autosp.integrations.transformers makes the class from TRL's on first use).

The training loss is TRL's DPO loss (loss_type 'sigmoid', the default) written as single-device code over the
policy and the reference model, which autosp shards: each sequence's log-probability of its completion is a sum
over the sequence (one pending sum under sp, resolved by one all-reduce), the chosen rows before the rejected ones
as TRL's collator stacks them; the reference's comes from `ref_model` in the same program (its parameters are
inputs that take no gradient) or from the batch (`precompute_ref_log_probs=True`). TRL's per-pair training
metrics are logged as TRL logs them (rewards, reward accuracy and margin, log-probabilities: the loss program
returns each pair's log-probabilities beside the loss); its per-token ones (entropy, mean logits, token accuracy)
are not, since no rank holds the whole logits. Evaluation is TRL's own, on the plain model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autosp.errors import AutospError
from autosp.integrations.transformers import AutospTrainerMixin


def completion_logps(model, input_ids, attention_mask, completion_mask):
    """Each row's log-probability of its completion tokens: sum over t of log p(ids[t+1] | ids[:t+1]) where
    completion_mask[t+1]. The next token and its mask are shifted (small tensors), not the logits."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    following = F.pad(input_ids, (0, 1))[:, 1:]
    scored = F.pad(completion_mask, (0, 1))[:, 1:]
    logp = logits.float().log_softmax(-1).gather(-1, following.unsqueeze(-1)).squeeze(-1)
    return (logp * scored).sum(1)


class DPOLoss(torch.nn.Module):
    """-logsigmoid(beta ((chosen - ref chosen) - (rejected - ref rejected))), the mean over the batch's pairs."""

    def __init__(self, policy: torch.nn.Module, ref: torch.nn.Module | None, beta: float):
        super().__init__()
        self.policy, self.ref, self.beta = policy, ref, beta

    def forward(self, input_ids, attention_mask, completion_mask, ref_chosen_logps=None, ref_rejected_logps=None):
        chosen, rejected = completion_logps(self.policy, input_ids, attention_mask, completion_mask).chunk(2)
        if ref_chosen_logps is None:
            ref_chosen_logps, ref_rejected_logps = completion_logps(
                self.ref, input_ids, attention_mask, completion_mask).chunk(2)
        margin = (chosen - ref_chosen_logps) - (rejected - ref_rejected_logps)
        # with each pair's log-probabilities, for TRL's reward metrics (per pair: whole on every rank)
        return -F.logsigmoid(self.beta * margin).mean(), chosen, rejected, ref_chosen_logps, ref_rejected_logps


class AutospDPOMixin(AutospTrainerMixin):
    """The sequence-parallel half of AutospDPOTrainer (with_autosp picks it for DPOTrainer and its subclasses)."""

    _sharded_losses = ("Trainer", "DPOTrainer")
    _BATCH = ("input_ids", "attention_mask", "completion_mask", "ref_chosen_logps", "ref_rejected_logps")

    def _check_loss(self) -> None:
        name = f"{type(self).__name__}(sp={self.sp})"
        unsupported = {"loss_type": (self.loss_types, ["sigmoid"]), "f_divergence_type": (self.f_divergence_type,
                       "reverse_kl"), "ld_alpha": (self.ld_alpha, None), "use_weighting": (self.use_weighting, False),
                       "MoE auxiliary loss": (self.aux_loss_enabled, False)}
        for key, (got, want) in unsupported.items():
            if got != want and not (key == "f_divergence_type" and str(got).endswith("reverse_kl")):
                raise AutospError(f"{name}: {key}={got!r}; autosp shards TRL's standard DPO loss (loss_type "
                                  f"'sigmoid', reverse KL). Fix: {key}={want!r} in DPOConfig, or DPOTrainer "
                                  "without sp.")
        if self.ref_model is None and not self.precompute_ref_logps:
            raise AutospError(f"{name}: no reference model (a PEFT model, whose reference is itself with its "
                              "adapters off, which autosp does not trace). Fix: DPOConfig(precompute_ref_log_probs="
                              "True), or pass ref_model=.")

    def _loss_module(self, model) -> torch.nn.Module:
        ref = None if self.precompute_ref_logps else self.accelerator.unwrap_model(self.ref_model)
        if ref is not None:
            # frozen, as TRL runs it under no_grad: its parameters are inputs of the program that take no gradient
            # (else they would get one, and the Trainer's clipping would count it)
            ref.requires_grad_(False)
            ref = self._autocast(ref)
        return DPOLoss(model, ref, self.beta)

    def _loss_batch(self, inputs: dict, num_items_in_batch) -> tuple[dict, int]:
        # the loss is a mean over each dp rank's pairs, and autosp averages it over dp: the global mean
        return {k: inputs[k] for k in self._BATCH if k in inputs}, 1

    def _logged(self, out, mode: str = "train"):
        """The loss, with TRL's per-pair metrics recorded as DPOTrainer records them (rewards, their accuracy and
        margin, the completions' log-probabilities; gathered over the world, whose sp ranks hold the same pairs,
        so each mean is the dp ranks' mean). Its per-token ones (entropy, mean logits, token accuracy), sums over
        the sequence too, would each hold another [tokens, vocabulary] fp32 tensor in the step: not recorded."""
        loss, chosen, rejected, ref_chosen, ref_rejected = (x.detach() if i else x for i, x in enumerate(out))
        chosen_rewards, rejected_rewards = self.beta * (chosen - ref_chosen), self.beta * (rejected - ref_rejected)
        gather, metrics = self.accelerator.gather, self._metrics[mode]
        for key, value in (("rewards/chosen", chosen_rewards), ("rewards/rejected", rejected_rewards),
                           ("rewards/accuracies", (chosen_rewards > rejected_rewards).float()),
                           ("rewards/margins", chosen_rewards - rejected_rewards),
                           ("logps/chosen", chosen), ("logps/rejected", rejected)):
            metrics[key].append(gather(value).mean().item())
        return loss

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """TRL's precomputed reference log-probabilities (`precompute_ref_log_probs=True`), kept in memory on every
        rank. TRL writes them to a cache file beside the dataset on rank 0 and reads that file on every rank; a
        dataset made in memory (Dataset.from_list) has its cache folder in each process's own temporary folder, so
        at 2 ranks rank 1 found no file and rank 0 waited for it in the first collective (a hang). Each rank
        scores its share of the pairs with the frozen model (TRL's own compute_ref_log_probs, whole sequences,
        forward only), the shares are gathered in order, and the two columns are added to the dataset here."""
        if self.args.world_size == 1:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        from datasets import IterableDataset
        from torch.utils.data import DataLoader
        if isinstance(dataset, IterableDataset):
            raise AutospError(f"{type(self).__name__}(sp={self.sp}): precompute_ref_log_probs=True with an "
                              f"IterableDataset for {name}: its rows cannot be scored before training. Fix: a "
                              "map-style dataset (datasets.Dataset), or pass ref_model= instead.")
        loader = self.accelerator.prepare(DataLoader(dataset, batch_size=batch_size, collate_fn=self.data_collator,
                                                     shuffle=False, num_workers=self.args.dataloader_num_workers))
        model = self.ref_model or self.model
        chosen, rejected = [], []
        for batch in loader:
            c, r = self.accelerator.gather_for_metrics(self.compute_ref_log_probs(model, batch))
            chosen.append(c.float().cpu())
            rejected.append(r.float().cpu())
        for column, values in (("ref_chosen_logps", chosen), ("ref_rejected_logps", rejected)):
            dataset = dataset.add_column(column, torch.cat(values).tolist())
        return dataset
