"""Preference pairs and DPO: the loss and every gradient against one device (sp 2, sp 4, dp 2 x sp 2), the planned
peak against the measured one, the pairs rendered token by token, bad rows refused with nothing written, and one
`autosp train --objective dpo` followed by `autosp eval` on the pairs."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from autosp.cli import main
from tests.dist import run_ranks

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = ["the cat sat on the mat", "a dog ran in the park", "what is two plus two", "four", "five",
         "blue sky green grass", "tell me a story", "once upon a time"]
MODEL = {"model_type": "llama", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny BPE tokenizer with a chat template, a 2-layer model folder, and 16 pairs (text and conversations)."""
    import random
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from extend_context import tokenizer
    root = tmp_path_factory.mktemp("dpo")
    tok = tokenizer(WORDS * 10, vocab=300)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(root / "tok"))
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(MODEL))
    r = random.Random(0)
    rows = []
    for i in range(16):
        p = " ".join(r.choice(WORDS) for _ in range(r.randint(1, 4)))
        if i % 2:
            rows.append({"prompt": p, "chosen": " four", "rejected": " five " + r.choice(WORDS)})
        else:
            rows.append({"prompt": [{"role": "user", "content": p}],
                         "chosen": [{"role": "assistant", "content": "four"}],
                         "rejected": {"role": "assistant", "content": "five " + r.choice(WORDS)}})
    _jsonl(root / "pairs.jsonl", rows)
    return root


def _jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


# ---------------------------------------------------------------- the loss against one device

def _pairs_batch(k: int, s: int, vocab: int, seed: int):
    """k pairs laid out as pairs.layout lays them out (prompts of random length, answers crossing the shard edges,
    right padding; the last pair's prompt cut), the k chosen rows first, then the k rejected."""
    from autosp.run.pairs import layout
    g = np.random.default_rng(seed)
    ids, labels = [[], []], [[], []]
    for i in range(k):
        prompt = g.integers(1, vocab, int(g.integers(s // 4, s // 2) if i < k - 1 else s)).tolist()
        answers = [g.integers(1, vocab, int(g.integers(s // 4, s // 2))).tolist() for _ in range(2)]
        keep = s - max(map(len, answers))
        for j, a in enumerate(answers):
            x, y, _ = layout(prompt, a, s, 0, keep)
            ids[j].append(x)
            labels[j].append(y)
    return (torch.from_numpy(np.stack(ids[0] + ids[1])), torch.from_numpy(np.stack(labels[0] + labels[1])),
            torch.from_numpy(g.normal(-40, 5, 2 * k)).float())


def _rows(x, pairs):
    """The rows of pairs `pairs` (chosen then rejected) of a [2k, ...] batch."""
    k = x.shape[0] // 2
    return torch.cat([x[pairs], x[[k + p for p in pairs]]])


def _exact_job(rank, world, cases, measure):
    """Per case (mesh shape, s, pairs): this rank's DPO loss, margins and grads against one device's; with
    `measure` (sp only), the planned and measured peak of the DPO step and of the reference pass."""
    import autosp
    from torch.distributed.device_mesh import init_device_mesh

    from autosp.memory import peak_bytes
    from autosp.run.dpo import dpo_loss, forward_peak, sequence_logps
    from tests.models import params_of, rank_errors, reference, tiny_llama
    torch.manual_seed(0)
    model = tiny_llama(vocab=64)
    params = params_of(model)
    fn = dpo_loss(model, beta=0.5)
    out, peaks = {}, []
    for shape, s, k in cases:
        names = ("sp",) if len(shape) == 1 else ("dp", "sp")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dp = shape[0] if len(shape) == 2 else 1
        ids, labels, ref = _pairs_batch(k, s, 64, seed=s)
        want_loss, want = reference(lambda p, *a: fn(p, *a)[0], params, ids, labels, ref)
        _, want_z = fn(params, ids, labels, ref)
        r = rank // shape[-1] if dp > 1 else 0
        mine = list(range(r * k // dp, (r + 1) * k // dp))
        step = autosp.value_and_grad(fn, mesh, has_aux=True)
        (loss, z), grads = step(params, _rows(ids, mine), _rows(labels, mine), _rows(ref, mine))
        errs = rank_errors(loss, grads, want_loss, want)
        errs["margins"] = float((z - want_z.detach()[mine]).abs().max() / want_z.abs().max())
        out[f"{shape} s {s}"] = errs
        if measure:
            vg = autosp.value_and_grad(fn, mesh, memory_budget=1.0, has_aux=True)
            vg(params, ids, labels, ref)                               # compiled outside the measurement
            measured, _ = peak_bytes(lambda: vg(params, ids, labels, ref))
            planned = vg.plan(params, ids, labels, ref).peak_bytes
            logps = autosp.shard(lambda p, i, lab: sequence_logps(model, p, i, lab), mesh)
            frozen = {n: v.detach() for n, v in params.items()}
            with torch.no_grad():
                logps(frozen, ids, labels)
                ref_measured, _ = peak_bytes(lambda: logps(frozen, ids, labels))
            ref_planned = forward_peak(lambda p, i, lab: sequence_logps(model, p, i, lab), mesh, (frozen, ids, labels),
                                       "cpu")
            peaks.append((s, planned, measured, ref_planned, ref_measured))
    return out, peaks


def test_dpo_loss_and_every_gradient_equal_one_device_and_the_plan_holds_its_peak():
    """fp32, a tiny Llama (hidden 32, 2 layers, vocab 64): answers across the shard edges, lengths divisible by sp and
    not, the last pair's prompt cut. sp 2 (45 and 48 tokens, 3 pairs), sp 4 (50 and 48), dp 2 x sp 2 (45, 4 pairs);
    at sp 2 the planned peak of the DPO step and of the reference pass against the measured ones."""
    from tests.models import assert_every_rank, assert_peak
    two = run_ranks(_exact_job, 2, [((2,), 45, 3), ((2,), 48, 3)], True)
    assert_every_rank([r[0] for r in two])
    four = run_ranks(_exact_job, 4, [((4,), 50, 3), ((4,), 48, 3), ((2, 2), 45, 4)], False)
    assert_every_rank([r[0] for r in four])
    for rank, (_, peaks) in enumerate(two):
        for s, planned, measured, ref_planned, ref_measured in peaks:
            assert_peak(planned, measured, atol=512, rtol=1e-4, what=f"DPO step, sp 2, s {s}, rank {rank}")
            assert_peak(ref_planned, ref_measured, atol=512, rtol=1e-4, what=f"reference pass, s {s}, rank {rank}")


# ---------------------------------------------------------------- the pairs, token by token

def test_pairs_are_rendered_token_by_token_and_cut_from_the_prompts_start(assets, tmp_path):
    from transformers import AutoTokenizer

    from autosp.run import pairs, text
    tok = AutoTokenizer.from_pretrained(str(assets / "tok"))
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]           # noqa: E731
    eos = tok.eos_token_id
    rows = [{"prompt": "the cat sat", "chosen": " four", "rejected": " five blue"},
            {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two plus two"}],
             "chosen": {"role": "assistant", "content": "four"},
             "rejected": [{"role": "assistant", "content": "five"}]},
            {"prompt": "once upon a time " * 12, "chosen": " four", "rejected": " five tell me a story"}]
    data = _jsonl(tmp_path / "p.jsonl", rows)
    L = 64
    cache, reused = pairs.tokenize_pairs(data, text.Tokenizer.of(str(assets / "tok")), seq_len=L,
                                         cache_dir=str(tmp_path / "c"))
    assert not reused and cache.pairs == 3 and cache.meta["cut"] == 1
    head = enc("<|system|>be brief<eos><|user|>two plus two<eos><|assistant|>")
    want = [(enc("the cat sat"), enc(" four") + [eos], enc(" five blue") + [eos]),
            (head, enc("four<eos>"), enc("five<eos>"))]
    long_prompt = enc("once upon a time " * 12)
    answers = (enc(" four") + [eos], enc(" five tell me a story") + [eos])
    want.append((long_prompt[len(long_prompt) - (L - max(map(len, answers))):], *answers))
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    for i, (prompt, *two) in enumerate(want):
        for j, answer in enumerate(two):
            ids, labels = cache.ids[i, j].tolist(), cache.labels[i, j].tolist()
            n = len(prompt) + len(answer)
            assert ids == prompt + answer + [pad] * (L - n), (i, j)
            assert labels == [-100] * len(prompt) + answer + [-100] * (L - n), (i, j)
    assert pairs.tokenize_pairs(data, text.Tokenizer.of(str(assets / "tok")), seq_len=L,
                                cache_dir=str(tmp_path / "c"))[1]            # the cache, reused
    # the same string pairs from Parquet and from a saved dataset, detected as pairs by their columns
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset
    strings = [rows[0], rows[2]]
    pq.write_table(pa.Table.from_pylist(strings), str(tmp_path / "p.parquet"))
    Dataset.from_list(strings).save_to_disk(str(tmp_path / "saved"))
    for other in (str(tmp_path / "p.parquet"), str(tmp_path / "saved")):
        assert pairs.is_pairs(other)
        got, _ = pairs.tokenize_pairs(other, text.Tokenizer.of(str(assets / "tok")), seq_len=L,
                                      cache_dir=str(tmp_path / "c"))
        assert got.ids.tolist() == cache.ids[[0, 2]].tolist() and got.labels.tolist() == cache.labels[[0, 2]].tolist()
    assert not pairs.is_pairs(_jsonl(tmp_path / "t.jsonl", [{"text": "a document"}]))
    # a step's batch: its pairs' chosen rows, then their rejected rows
    rows_, ids, labels = pairs.pair_batch(cache, batch=2, step=0, seed=0)
    assert ids.tolist() == [cache.ids[r, 0].tolist() for r in rows_] + [cache.ids[r, 1].tolist() for r in rows_]


def test_bad_pairs_exit_2_naming_the_file_row_and_fix_with_nothing_written(assets, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raising = tmp_path / "raising"
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(assets / "tok"))
    tok.chat_template = "{{ raise_exception('this template renders no system turns') }}"
    tok.save_pretrained(str(raising))
    good = {"prompt": "the cat", "chosen": " four", "rejected": " five"}
    msgs = {"prompt": [{"role": "user", "content": "hi"}], "chosen": {"role": "assistant", "content": "four"},
            "rejected": {"role": "assistant", "content": "five"}}
    cases = [([good, {"prompt": "x", "chosen": " four"}], None, "line 2: it has no 'rejected'"),
             ([good, {"prompt": "x", "chosen": " four", "rejected": " four"}], None,
              "line 2: its chosen and rejected answers are the same"),
             ([dict(msgs, prompt=[{"role": "wizard", "content": "hi"}])], None, "line 1: its 'prompt' has the unknown "
              "role 'wizard'"),
             ([msgs], str(raising), "line 1: the tokenizer's chat template raised"),
             ([{"prompt": "x " * 40, "chosen": " four " * 40, "rejected": " five"}], None, "leaves no prompt token")]
    for i, (rows, tok_dir, hint) in enumerate(cases):
        data = _jsonl(tmp_path / f"bad{i}.jsonl", rows)
        argv = ["train", "--model", str(assets / "model"), "--tokenizer", tok_dir or str(assets / "tok"), "--data",
                data, "--objective", "dpo", "--seq-len", "32", "--out", str(tmp_path / "run"), "--cache-dir",
                str(tmp_path / "cache")]
        assert main(argv) == 2, hint
        err = capsys.readouterr().err
        assert data in err and hint in err and "Fix:" in err, (hint, err)
    assert main(["train", "--model", str(assets / "model"), "--tokenizer", str(assets / "tok"), "--objective", "dpo",
                 "--data", _jsonl(tmp_path / "text.jsonl", [{"text": "a document"}]), "--out", str(tmp_path / "run"),
                 "--cache-dir", str(tmp_path / "cache")]) == 2
    assert "not preference pairs" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == sorted([f"bad{i}.jsonl" for i in range(len(cases))]
                                                  + ["raising", "text.jsonl"])     # no run folder, no cache


# ---------------------------------------------------------------- the run, end to end

def _eval_job(rank, world, a):
    """`autosp eval`'s worker on a pool's ranks (their process group is the pool's): the model, the sharded
    preference pass, rank 0's eval.json."""
    import autosp
    from torch.distributed.device_mesh import init_device_mesh

    from autosp.run import evaluate, preference
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    model = evaluate.build(a, torch.device("cpu")).eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    result = preference.evaluate(a, model, params, mesh, 0, 1, torch.device("cpu"), autosp)
    if rank == 0:
        evaluate._report(a, result)
    return result


def test_train_dpo_at_sp2_then_eval_reports_preference_accuracy(assets, tmp_path):
    """Step 1's loss is ln 2 (the policy is the reference it was measured against), the margins and accuracy are in
    metrics.jsonl, the reference table is in the run folder. Then `autosp eval` on the pairs (detected from the
    columns; checked here, its worker run on the test's ranks rather than launched): eval.json in the run folder."""
    from autosp.cli import check_eval, parser
    from tests.test_cli import launched
    out = tmp_path / "run"
    common = ["--tokenizer", str(assets / "tok"), "--data", str(assets / "pairs.jsonl"), "--sp", "2", "--seq-len",
              "30", "--batch", "2", "--cache-dir", str(tmp_path / "cache")]
    code, stdout, stderr, _ = launched(["train", "--model", str(assets / "model"), "--objective", "dpo", "--steps",
                                        "3", "--lr", "1e-2", "--out", str(out), *common])
    assert code == 0, stderr
    assert "DPO: 2 pairs per step = 4 sequences; reference: the frozen starting model, precomputed" in stdout, stdout
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert abs(rows[0]["loss"] - np.log(2)) < 1e-6 and rows[0]["reward_margin"] == 0.0
    assert rows[-1]["loss"] < rows[0]["loss"] and all("reward_accuracy" in r for r in rows)
    assert np.isfinite(np.load(out / "reference.npy")).sum() >= 6 * 2       # the pairs of its 3 steps
    a = parser().parse_args(["eval", "--model", str(out), "--reference", str(assets / "model"), *common])
    check_eval(a)
    assert a.step.objective == "dpo" and a.out == str(out)
    got = run_ranks(_eval_job, 2, a)
    result = json.load(open(out / "eval.json"))
    assert result == got[0] == got[1]
    assert result["kind"] == "preference" and result["pairs"] == 16 and 0 <= result["accuracy"] <= 1
    from autosp.run.preference import lines
    assert result["against"].startswith("the reference") and "preference accuracy 1.0000" in lines(result)[1]


def test_train_dpo_with_lora_measures_against_the_base_then_eval_reads_the_adapters(assets, tmp_path):
    """DPO with LoRA: the reference pass over the starting model is the base's (peft starts every B at zero), so
    step 1's loss is ln 2 and its margins 0 exactly, with no second copy of the model; `autosp eval` of the LoRA run
    (the base with its trained adapters) reports its preference accuracy."""
    from autosp.cli import check_eval, parser
    from tests.test_cli import launched
    out = tmp_path / "run"
    common = ["--tokenizer", str(assets / "tok"), "--data", str(assets / "pairs.jsonl"), "--sp", "2", "--seq-len",
              "30", "--batch", "2", "--cache-dir", str(tmp_path / "cache")]
    code, stdout, stderr, _ = launched(["train", "--model", str(assets / "model"), "--objective", "dpo", "--lora-r",
                                        "4", "--steps", "2", "--lr", "5e-2", "--out", str(out), *common])
    assert code == 0, stderr
    assert "reference: the frozen starting model, precomputed" in stdout, stdout
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert abs(rows[0]["loss"] - np.log(2)) < 1e-6 and rows[0]["reward_margin"] == 0.0, rows[0]
    assert rows[1]["reward_margin"] != 0.0, rows        # the adapters moved the policy off its reference
    a = parser().parse_args(["eval", "--model", str(out), "--reference", str(assets / "model"), *common])
    check_eval(a)
    result = run_ranks(_eval_job, 2, a)[0]
    assert result["kind"] == "preference" and result["pairs"] == 16 and result["against"].startswith("the reference")
