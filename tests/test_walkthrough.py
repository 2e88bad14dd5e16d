"""README's walkthrough "Extend a model's context", run as a user runs it: a small Llama and its tokenizer made from
text that ships with Python, trained on JSONL documents at 4x its positions with YaRN at sp 2 (and at sp 1 beside
it: packed documents are exact against one device), exported to a Hugging Face folder, evaluated (loss by
position) and passkey-tested; then the checks on what each command wrote. The asset script runs in a process of its
own; the `autosp` commands run through `cli.main` in this one, one after the other, as `autosp` runs them
(tests/test_cli.launched: the ranks are real processes, the launcher's imports are this process's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.test_cli import ROOT, launched, losses


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    """The walkthrough's commands, once: (assets folder, run at sp 2, run at sp 1, eval output, cache folder, the
    commands' (exit code, stdout, stderr, seconds))."""
    base = tmp_path_factory.mktemp("walk")
    demo, cache = base / "demo", base / "cache"
    p = subprocess.run([sys.executable, "examples/extend_context.py", "--out", str(demo), "--quick"], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr
    common = ["--model", str(demo / "llama"), "--data", str(demo / "docs.jsonl"), "--cache-dir", str(cache),
              "--seq-len", "1024", "--rope-scaling", "yarn:4", "--batch", "2", "--steps", "3", "--timeout", "120",
              "--eval-every", "3"]         # the same held-out part on both sides: the same training order
    runs = {sp: base / f"run-sp{sp}" for sp in (1, 2)}
    trained = [launched(["train", *common, "--sp", "2", "--export", "--out", str(runs[2])], timeout=400),
               launched(["train", *common, "--sp", "1", "--out", str(runs[1])], timeout=400)]
    for rc, _, stderr, _ in trained:
        assert rc == 0, stderr
    out = base / "eval"
    evals = [
        launched(["eval", "--model", str(runs[2]), "--data", str(demo / "docs.jsonl"), "--cache-dir", str(cache),
                  "--seq-len", "1024", "--sp", "2", "--batches", "2", "--out", str(out), "--timeout", "120"], timeout=400),
        launched(["eval", "--model", str(runs[2] / "hf"), "--passkey", "--lengths", "256,1024", "--depths", "0,0.5,1",
                  "--samples", "2", "--sp", "2", "--out", str(out), "--timeout", "120"], timeout=400)]
    for rc, _, stderr, _ in evals:
        assert rc == 0, stderr
    return demo, runs, out, cache, trained, evals


def test_packed_documents_train_at_sp2_what_they_train_at_sp1(walk):
    demo, runs, _, cache, trained, _ = walk
    got, want = losses(runs[2]), losses(runs[1])
    rel = [abs(a - b) / abs(b) for a, b in zip(got, want)]
    print(f"packed documents, YaRN x4, 1,024 tokens: --sp 2 against --sp 1, relative loss difference {rel}")
    assert len(got) == 3 and max(rel) <= 1e-5, (got, want)
    stdout = trained[0][1]
    assert "packing docs" in stdout and "'rope_type': 'yarn'" in stdout and "1,024 positions" in stdout, stdout
    rows = [json.loads(line) for line in (runs[2] / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval_loss"] > 0 and rows[-1]["eval_perplexity"] > 1
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(runs[2] / "tb"))
    # the run records the RoPE settings it trained with, and the tokenizer, for export and eval
    cfg = json.loads((runs[2] / "config.json").read_text())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and cfg["max_position_embeddings"] == 1024
    assert (runs[2] / "tokenizer" / "tokenizer.json").is_file()


def test_the_tokenized_cache_is_the_tokenizers_and_is_reused(walk):
    from transformers import AutoTokenizer

    from autosp.run import text
    demo, runs, _, cache, _, evals = walk
    tok = text.Tokenizer.of(str(demo / "llama"))
    found, reused = text.tokenize(str(demo / "docs.jsonl"), tok, cache_dir=str(cache), progress=False)
    assert reused and len(os.listdir(cache)) == 1               # one cache, however many runs read it
    ref = AutoTokenizer.from_pretrained(str(demo / "llama"))
    docs = [json.loads(line)["text"] for line in (demo / "docs.jsonl").read_text().splitlines()]
    want = []
    for d in docs[:5]:
        want += ref(d, add_special_tokens=False)["input_ids"] + [ref.eos_token_id]
    assert found.tokens[:len(want)].tolist() == want
    assert "reused the cache" in evals[0][1], evals[0][1]        # eval read the training run's cache


def test_export_loads_with_from_pretrained_with_the_checkpoints_logits(walk):
    from transformers import AutoModelForCausalLM

    from autosp.run.export import load_run
    from autosp.run.models import build_model, model_config
    _, runs, _, _, _, _ = walk
    trained, _ = load_run(str(runs[2]))
    hf = AutoModelForCausalLM.from_pretrained(str(runs[2] / "hf")).eval()
    assert hf.config.rope_parameters["rope_type"] == "yarn" if hasattr(hf.config, "rope_parameters") else True
    ids = torch.randint(0, hf.config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = trained(ids).logits, hf(ids).logits
    assert (a - b).abs().max() <= 1e-6 * a.abs().max(), (a - b).abs().max()
    init = build_model(model_config(str(runs[2])), seed=0)      # the config's init: the checkpoint is not it
    assert any(not torch.equal(p, q) for p, q in zip(trained.parameters(), init.parameters()))
    assert sorted(f for f in os.listdir(runs[2] / "hf") if f.startswith("tokenizer")) == ["tokenizer.json",
                                                                                         "tokenizer_config.json"]


def test_eval_and_passkey_write_their_tables_and_pictures(walk):
    _, runs, out, _, _, evals = walk
    result = json.loads((out / "eval.json").read_text())
    assert result["loss"] > 0 and len(result["buckets"]) == 8 and result["packing"] == "docs"
    assert "loss by position: 0-128:" in evals[0][1], evals[0][1]
    passkey = json.loads((out / "passkey.json").read_text())
    assert passkey["lengths"] == [256, 1024] and np.asarray(passkey["accuracy"]).shape == (2, 3)
    assert "| 1,024 |" in evals[1][1], evals[1][1]
    for png in ("eval.png", "passkey.png"):
        assert (out / png).stat().st_size > 5_000


def _same_batch_job(rank, world, run, cache_dir, data):
    """On one batch of the run's data: the training step's loss and eval's bucketed loss, both sharded over sp;
    the passkey verdicts sharded and on one device."""
    from torch.distributed.device_mesh import init_device_mesh

    import autosp
    from autosp.run import text
    from autosp.run.data import batch_inputs, corpus_of
    from autosp.run.evaluate import answer_hits, bucket_loss, passkey_batch
    from autosp.run.export import load_run
    from autosp.run.plan import step_loss
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    model, _ = load_run(run)
    params = dict(model.named_parameters())
    tok = text.Tokenizer.of(os.path.join(run, "tokenizer"))
    corpus = corpus_of(text.find(data, tok, "text", cache_dir))
    batch = [torch.from_numpy(x) for x in batch_inputs(corpus, seq_len=1024, batch=2, step=5, seed=0, packing="docs")]
    loss, _ = autosp.value_and_grad(lambda p, i, lab, pos: step_loss(model, p, i, lab, pos), mesh)(params, *batch)
    with torch.no_grad():
        sums, counts = autosp.shard(lambda p, i, lab, pos: bucket_loss(model, p, i, lab, pos, 8), mesh)(params, *batch)
        ids, labels = passkey_batch(tok.load(), 512, 0.5, 2, np.random.default_rng(0))
        ids, labels = torch.from_numpy(ids), torch.from_numpy(labels)
        sharded = autosp.shard(lambda p, i, lab: answer_hits(model, p, i, lab, None), mesh)(params, ids, labels)
        single = answer_hits(model, params, ids, labels, None)
    return float(loss), float(sums.sum() / counts.sum()), [t.tolist() for t in sharded], [t.tolist() for t in single]


def test_eval_loss_on_a_batch_is_the_training_steps_loss(walk):
    from tests.dist import run_ranks
    demo, runs, _, cache, _, _ = walk
    for train_loss, eval_loss, sharded, single in run_ranks(_same_batch_job, 2, str(runs[2]), str(cache),
                                                            str(demo / "docs.jsonl")):
        assert abs(train_loss - eval_loss) <= 1e-5 * train_loss, (train_loss, eval_loss)
        assert sharded == single and sum(single[1]) > 0, (sharded, single)
