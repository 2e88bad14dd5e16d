"""autosp.integrations.transformers: the Trainer (and TRL's SFTTrainer and DPOTrainer) at sp 2, the Trainer at
dp 2 too, equal the same trainer on one device (losses, gradient norms and the parameters after each step, fp32,
a length sp does not divide), the README's example script runs, and bad use is an AutospError naming the fix.
bench/trainer_meshes.py runs the same cases at dp 2 x sp 2 and sp 4."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F

from tests.dist import run_ranks
from tests.models import RTOL

S, ROWS, STEPS = 45, 8, 3          # 45 tokens: not a multiple of sp
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
DOCS = ["The grass is green and the sky is blue.", "A second document, longer than the first one by a little, "
        "with a few more words in it so that it fills the sequence.", "Third: it has numbers 12345 and {}[].",
        "Short one.", "Sequence parallelism splits every activation along the sequence over the ranks."]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(vocab: int, tokens_only: bool = False) -> list[dict]:
    """ROWS sequences of S ids; labels with a prompt of growing length that is not trained on."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(ROWS):
        ids = torch.randint(0, vocab, (S,), generator=g)
        labels = ids.clone()
        labels[: 3 + i] = -100
        out.append({"input_ids": ids.tolist()} if tokens_only else {"input_ids": ids, "labels": labels})
    return out


class _Snapshots:
    """The parameters after each optimizer step (a TrainerCallback, made where transformers is imported)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Snap(TrainerCallback):
            def __init__(self):
                self.steps = []

            def on_step_end(self, args, state, control, model=None, **kwargs):
                self.steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return Snap()


def _args(out: str, batch: int, **extra):
    from transformers import TrainingArguments
    cls = TrainingArguments
    if extra.pop("sft", False):
        from trl import SFTConfig as cls
    if extra.pop("dpo", False):
        from trl import DPOConfig as cls
    extra = {"learning_rate": 5e-3, "save_strategy": "no", **extra}
    return cls(output_dir=out, per_device_train_batch_size=batch, max_steps=STEPS, gradient_accumulation_steps=2,
               max_grad_norm=0.5, logging_steps=1, report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
               **extra)


def _losses(trainer) -> list[float]:
    """The loss and the gradient norm (before clipping) the trainer logged at each step."""
    return [x for h in trainer.state.log_history if "loss" in h for x in (h["loss"], h["grad_norm"])]


def _evaluated(trainer) -> float:
    """The eval loss of the trained model on the first 8 rows (the same rows in the same eval batches as on one
    device: per_device_eval_batch_size is rows per dp group, as for training)."""
    return trainer.evaluate(eval_dataset=_rows(64)[:8])["eval_loss"]


def _trainer_run(cls, out: str, batch: int, bf16: bool = False, **kw):
    """3 steps of a tiny Llama (hidden 32, 2 layers) in 2 micro-batches each, clipped, by SGD: its update is linear
    in the gradient, so the parameters hold it to 1e-5 (AdamW's first update, lr g / (|g| + eps), turns the fp32
    rounding of entries near eps into changes of order lr; the example's run is AdamW's, held by its losses)."""
    from tests.models import tiny_llama
    torch.manual_seed(0)
    snaps = _Snapshots()
    trainer = cls(model=tiny_llama(), args=_args(out, batch, optim="sgd", learning_rate=0.5, bf16=bf16,
                                                 per_device_eval_batch_size=batch),
                  train_dataset=_rows(64), callbacks=[snaps], **kw)
    trainer.train()
    return trainer, _losses(trainer), snaps.steps


def _sft_run(cls, out: str, folder: str, batch: int = 2, **kw):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    trainer = cls(model=model, args=_args(out, batch, sft=True, max_length=None, bf16=False), processing_class=tok,
                  train_dataset=Dataset.from_list(_rows(len(tok), tokens_only=True)), **kw)
    trainer.train()
    return _losses(trainer)


def _tokenizer(folder: str):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    tok.pad_token = tok.eos_token
    return tok


def _pairs():
    """Preference pairs: a prompt, the chosen and the rejected completion (text)."""
    from datasets import Dataset
    return Dataset.from_list([{"prompt": DOCS[i % 5][:20], "chosen": DOCS[(i + 1) % 5][:15],
                               "rejected": DOCS[(i + 2) % 5][:12]} for i in range(ROWS)])


_REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected")


def _dpo_run(cls, out: str, folder: str, batch: int = 2, precompute: bool = False, **kw):
    """DPO of the tiny Llama against a frozen copy of itself, pairs padded to S tokens; `precompute`: its reference
    log-probabilities scored before training (TRL's precompute_ref_log_probs), no reference model kept. The losses
    and gradient norms, then TRL's per-pair metrics of each logged step."""
    import copy

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder)
    args = _args(out, batch, dpo=True, optim="sgd", learning_rate=0.5, bf16=False, pad_to_multiple_of=S,
                 precompute_ref_log_probs=precompute, per_device_eval_batch_size=batch)
    trainer = cls(model=model, ref_model=None if precompute else copy.deepcopy(model),
                  processing_class=_tokenizer(folder), train_dataset=_pairs(),
                  eval_dataset=_pairs().select(range(8)), args=args, **kw)
    trainer.train()
    evaluated = trainer.evaluate()
    return (_losses(trainer) + [h[k] for h in trainer.state.log_history if "loss" in h for k in _REWARDS],
            [evaluated["eval_loss"]] + [evaluated[f"eval_{k}"] for k in _REWARDS])


def _example_run(assets: dict, sp: int, out: str, batch: int = 2) -> list[float]:
    trainer = _example("keep_your_trainer").main(
        ["--model", assets["model"], "--data", assets["data"], "--seq-len", str(S), "--sp", str(sp), "--out", out,
         "--steps", str(STEPS), "--batch", str(batch), "--grad-accum", "2"])
    return _losses(trainer)


class _RunningMaxLM(torch.nn.Module):
    """A language model autosp cannot shard: a running maximum along the sequence after attention (no rule)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)

    def forward(self, input_ids, labels=None, **kwargs):
        b, s = input_ids.shape
        q = self.emb(input_ids).view(b, s, 4, 8).transpose(1, 2)                  # (B, nh, T, hs)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(b, s, 32)
        logits = self.head(a.cummax(dim=1).values)
        return {"loss": F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())}


def _ranks(rank, world, assets):
    import tempfile
    os.environ["OMP_NUM_THREADS"] = "1"          # else accelerate sets this pooled process's torch threads
    from autosp.errors import AutospError
    from autosp.integrations.transformers import AutospDPOTrainer, AutospSFTTrainer, AutospTrainer
    out = {}
    with tempfile.TemporaryDirectory() as d:
        trainer, out["sp2"], out["sp2 params"] = _trainer_run(AutospTrainer, d, 2, sp=2)
        out["sp2 eval"] = _evaluated(trainer)
        (local, *_), = trainer.model_wrapped._steps[True]._cache.values()
        (evaluated, *_), = trainer.model_wrapped._steps[False]._cache.values()
        out["sp2 all_to_all"] = [sum(e.op.name == "all_to_all" for e in g.eqns) for g in (local, evaluated)]
        trainer, out["dp2"], out["dp2 params"] = _trainer_run(AutospTrainer, d, 1, sp=1)
        out["dp2 eval"] = _evaluated(trainer)
        trainer_bf16, out["bf16 sp2"], _ = _trainer_run(AutospTrainer, d, 2, bf16=True, sp=2)
        (local, *_), = trainer_bf16.model_wrapped._steps[True]._cache.values()
        out["bf16 sp2 linears"] = {e.outputs[0].dtype for e in local.eqns if e.op.name == "linear"}
        out["sft sp2"] = _sft_run(AutospSFTTrainer, d, assets["model"], sp=2)
        out["dpo sp2"], out["dpo sp2 eval"] = _dpo_run(AutospDPOTrainer, d, assets["model"], sp=2)
        # TRL's cache file of an in-memory dataset is in each process's own temporary folder: rank 1 failed to
        # read rank 0's and rank 0 hung in the first collective
        out["dpo precomputed sp2"], out["dpo precomputed sp2 eval"] = _dpo_run(AutospDPOTrainer, d, assets["model"],
                                                                               sp=2, precompute=True)
        out["example sp2"] = _example_run(assets, 2, d)
        for key, inputs in (("no labels", {"input_ids": torch.zeros(2, S, dtype=torch.long)}),):
            try:
                trainer.compute_loss(trainer.model_wrapped.train(), inputs)
            except AutospError as exc:
                out[key] = str(exc)
        try:
            AutospTrainer(model=_RunningMaxLM(), args=_args(d, 2), train_dataset=_rows(64), sp=2).train()
        except AutospError as exc:
            out["no rule"] = str(exc)
    torch.set_num_threads(1)
    return out


def make_assets(folder) -> dict:
    """A tiny Llama folder with its tokenizer (a byte-level BPE), and a JSONL of documents, under `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = _example("extend_context").tokenizer(DOCS * 10, vocab=300)
    tok.save_pretrained(os.path.join(folder, "model"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(os.path.join(folder, "model"))
    with open(os.path.join(folder, "docs.jsonl"), "w") as f:
        for doc in DOCS * 8:          # 40 rows: whole steps at up to 8 rows a step, one device or dp 2
            f.write(json.dumps({"text": doc}) + "\n")
    return {"model": os.path.join(folder, "model"), "data": os.path.join(folder, "docs.jsonl")}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return make_assets(str(tmp_path_factory.mktemp("trainer")))


def _off(got: list[float], want: list[float], head: int = 2 * STEPS) -> float:
    """The largest relative difference of the losses and gradient norms (the first `head`: each step's two, or an
    evaluation's loss); a DPO run's metrics follow, against the scale of what they are computed from: the
    log-probabilities' for those, beta (0.1, DPOConfig's default) times it for the rewards, their accuracy and
    margins (differences of log-probabilities, 0 at the first step)."""
    assert len(got) == len(want) and len(want) in (head, head + len(_REWARDS) * max(1, head // 2)), (got, want)
    metrics = want[head:]
    logps = max((abs(x) for i, x in enumerate(metrics) if _REWARDS[i % len(_REWARDS)].startswith("logps")),
                default=0.0)
    scales = [logps * (1.0 if _REWARDS[i % len(_REWARDS)].startswith("logps") else 0.1) for i in range(len(metrics))]
    return max([abs(a - b) / abs(b) for a, b in zip(got[:head], want)]
               + [abs(a - b) / c for a, b, c in zip(got[head:], metrics, scales)])


def _params_off(got: list[dict], want: list[dict]) -> float:
    assert len(got) == len(want) == STEPS
    return max(((g[n] - w[n]).abs().max() / w[n].abs().max()).item() for g, w in zip(got, want) for n in w)


def test_trainer_sft_and_dpo_at_sp2_and_dp2_equal_one_device_and_the_example_runs(assets, tmp_path):
    from transformers import Trainer
    from trl import DPOTrainer, SFTTrainer
    trainer, want, want_params = _trainer_run(Trainer, str(tmp_path / "one"), 2)
    want_eval = _evaluated(trainer)
    _, want_bf16, _ = _trainer_run(Trainer, str(tmp_path / "bf16"), 2, bf16=True)
    want_sft = _sft_run(SFTTrainer, str(tmp_path / "sft"), assets["model"])
    want_dpo, want_dpo_eval = _dpo_run(DPOTrainer, str(tmp_path / "dpo"), assets["model"])
    want_precomputed, want_precomputed_eval = _dpo_run(DPOTrainer, str(tmp_path / "dpo-pre"), assets["model"],
                                                       precompute=True)
    want_example = _example_run(assets, 1, str(tmp_path / "example"))
    for rank, got in enumerate(run_ranks(_ranks, 2, assets)):
        assert min(got["sp2 all_to_all"]) > 0, ("the step or its evaluation was not sequence-parallel",
                                                got["sp2 all_to_all"])
        # the eval loss of the trained model, sequence-parallel (sp 2) and sharded over dp (dp 2), as one device's
        for key in ("sp2 eval", "dp2 eval"):
            assert abs(got[key] - want_eval) <= RTOL * abs(want_eval), (rank, key, got[key], want_eval)
        for key, ref in (("sp2", want), ("dp2", want), ("sft sp2", want_sft), ("dpo sp2", want_dpo),
                         ("dpo precomputed sp2", want_precomputed), ("example sp2", want_example)):
            assert _off(got[key], ref) <= RTOL, (rank, key, got[key], ref)
        for key, ref in (("dpo sp2 eval", want_dpo_eval), ("dpo precomputed sp2 eval", want_precomputed_eval)):
            assert _off(got[key], ref, head=1) <= RTOL, (rank, key, got[key], ref)
        # bf16=True: the step autocast as accelerate's prepare would have (every linear in bf16); the first loss as
        # one device's, the rest within bf16's rounding of the gradients (measured 4.4e-5 on one CI machine and
        # 1.25e-4 on another: each rank's bf16 weight-gradient products are summed in fp32, where one device rounds a
        # single product; fp32's run is 8.5e-5 from bf16's, so that bf16 ran is what the linears' dtype shows)
        assert got["bf16 sp2 linears"] == {torch.bfloat16}, (rank, got["bf16 sp2 linears"])
        assert abs(got["bf16 sp2"][0] - want_bf16[0]) <= 1e-6 * abs(want_bf16[0]), (rank, got["bf16 sp2"], want_bf16)
        assert _off(got["bf16 sp2"], want_bf16) <= 5e-4, (rank, got["bf16 sp2"], want_bf16)
        for key in ("sp2 params", "dp2 params"):
            assert _params_off(got[key], want_params) <= RTOL, (rank, key)
        assert "the batch has no 'labels'" in got["no labels"] and "DataCollatorForLanguageModeling" in got["no labels"]
        bad = got["no rule"]
        assert "AutospTrainer(sp=2): autosp cannot compile the training step of _RunningMaxLM on input_ids [2, 45]" in bad \
            and "cummax" in bad and "test_trainer.py" in bad and "Fix" in bad, bad


def test_bad_use_is_an_autosp_error_naming_the_fix(assets, tmp_path, monkeypatch):
    from transformers import Trainer

    from autosp.errors import AutospError
    from autosp.integrations import transformers as integration
    from autosp.integrations.transformers import AutospTrainer, _shard_over_dp, with_autosp
    from tests.models import tiny_llama
    model, args, data = tiny_llama(), _args(str(tmp_path), 2), _rows(64)
    with pytest.raises(AutospError, match=r"the world has 1 rank, which sp=2 does not divide.*Fix: launch a "
                                          r"multiple of 2 ranks \(torchrun --nproc-per-node 2"):
        AutospTrainer(model=model, args=args, train_dataset=data, sp=2)
    for sp in (0, None):
        with pytest.raises(AutospError, match=rf"sp={sp}\): sp is the number of ranks .* an int >= 1. Fix: sp=2"):
            AutospTrainer(model=model, args=args, train_dataset=data, sp=sp)
    with pytest.raises(AutospError, match=r"fp16=True scales the loss by accelerate's GradScaler.*Fix: bf16=True"):
        AutospTrainer(model=model, args=_args(str(tmp_path), 2, fp16=True), train_dataset=data, sp=1)
    with pytest.raises(AutospError, match="label_smoothing_factor need the whole logits.*Fix: drop them"):
        AutospTrainer(model=model, args=_args(str(tmp_path), 2, label_smoothing_factor=0.1), train_dataset=data, sp=1)

    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).logits.square().mean()
    with pytest.raises(AutospError, match=r"AutospMyTrainer\(sp=2\): MyTrainer.compute_loss .* computes its own loss"
                                          r".*Fix: compute the loss in the model's forward"):
        with_autosp(MyTrainer)(model=model, args=args, train_dataset=data, sp=2)
    with pytest.raises(AutospError, match=r"with_autosp\(<class 'int'>\): expected a subclass of transformers.Trainer"):
        with_autosp(int)
    from trl import DPOConfig, DPOTrainer
    dpo = DPOConfig(output_dir=str(tmp_path), loss_type=["ipo"], use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(AutospError, match=r"AutospDPOTrainer\(sp=1\): loss_type=\['ipo'\]; autosp shards TRL's "
                                          r"standard DPO loss .*Fix: loss_type=\['sigmoid'\]"):
        integration.AutospDPOTrainer(model=model, ref_model=tiny_llama(), args=dpo, processing_class=_tokenizer(
            assets["model"]), train_dataset=_pairs(), sp=1)
    with pytest.raises(AutospError, match=r"AutospMyDPO\(sp=1\): MyDPO.compute_loss .* computes its own loss"):
        with_autosp(type("MyDPO", (DPOTrainer,), {"compute_loss": lambda self, *a, **k: None}))(model=model, sp=1)
    with pytest.raises(AutospError, match=r"training DataLoader \(DataLoader over list\) is not one whose rows can be "
                                          r"sharded over the dp ranks only.*Fix: a map-style dataset"):
        _shard_over_dp(torch.utils.data.DataLoader([1, 2]), 2, 0, "AutospTrainer")
    monkeypatch.delitem(integration.__dict__, "AutospSFTTrainer", raising=False)
    monkeypatch.setitem(__import__("sys").modules, "trl", None)     # TRL not installed
    with pytest.raises(AutospError, match="AutospSFTTrainer extends TRL's SFTTrainer, and TRL is not installed.*"
                                          "Fix: pip install trl"):
        integration.AutospSFTTrainer
