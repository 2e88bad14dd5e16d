"""Chat data: conversations rendered by the tokenizer's chat template, the answer mask checked token by token against
the template; the loss on the answers as the mean over the global batch's answer tokens, exact against one device at
sp 2, sp 4 and dp 2 x sp 2; bad rows exit 2 naming the row with nothing written; `autosp train` then `autosp eval`
on chat JSONL, and where eval writes."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from autosp.cli import main
from autosp.run import chat, text
from autosp.run.data import Corpus, batch_inputs, corpus_of

# ChatML, as many instruct models write it; the answer of a turn is its content and <|im_end|>
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the same template with {% generation %} around each answer: transformers' own assistant mask, the oracle
CHATML_GENERATION = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                     "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}"
                     "<|im_end|>{% endif %}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# a plain template with no special tokens at all, which refuses a system message
PLAIN = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages') }}{% endif %}"
         "{{ m['role'] }} : {{ m['content'] }} .\n{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}")

CONVERSATIONS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the sky"},
     {"role": "assistant", "content": "the sky is blue"}],
    [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "green"},
     {"role": "user", "content": "and another one please"}, {"role": "assistant", "content": "blue and then yellow"}],
    [{"role": "user", "content": "a question with no answer"}],
    [{"role": "user", "content": "the grass is green and the sun is yellow and the sky is blue " * 3},
     {"role": "assistant", "content": "yes the grass is green"}],
]
WORDS = " ".join(m["content"] for c in CONVERSATIONS for m in c).split() + ["user", "assistant", "system"]


def chat_tokenizer(template: str | None = CHATML):
    """A word-piece BPE of under 128 ids (whitespace splits words, so no token crosses a turn's edge), with ChatML's
    special tokens and `template` as its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<eos>", "<unk>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(WORDS * 4, trainers.BpeTrainer(vocab_size=110, special_tokens=specials,
                                                           show_progress=False))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>",
                                  additional_special_tokens=specials[2:])
    if template is not None:
        out.chat_template = template
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("chat-tok")
    chat_tokenizer().save_pretrained(str(folder))
    return str(folder)


def _jsonl(path, rows, field="messages"):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({field: r, "id": 1}) + "\n")
    return str(path)


def _runs(mask):
    """The maximal runs of 1 in a 0/1 list, as (start, end)."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_the_answers_are_the_assistant_turns_token_by_token():
    tok = chat_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for conv in CONVERSATIONS:
        ids, mask = chat.render(tok, conv, CHATML)
        assert ids == tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]
        # each answer: the turn's content and its <|im_end|>, nothing of the prompt, in order
        want = [tok(m["content"], add_special_tokens=False)["input_ids"] + [end]
                for m in conv if m["role"] == "assistant"]
        assert [ids[a:b] for a, b in _runs(mask)] == want, conv
        # transformers' own mask from a template marked with {% generation %} agrees on every token
        marked = tok.apply_chat_template(conv, chat_template=CHATML_GENERATION, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        assert marked["input_ids"] == ids and list(marked["assistant_masks"]) == mask, conv
    # a template with no special tokens: found the same way
    plain = chat_tokenizer(PLAIN)
    ids, mask = chat.render(plain, CONVERSATIONS[1], PLAIN)
    dot = plain(".", add_special_tokens=False)["input_ids"]
    assert [ids[a:b] for a, b in _runs(mask)] == [plain("green", add_special_tokens=False)["input_ids"] + dot,
                                                  plain("blue and then yellow", add_special_tokens=False)["input_ids"]
                                                  + dot]


def test_the_cache_keeps_the_answer_mask_and_the_labels_are_the_answers(tok_dir, tmp_path):
    tok = text.Tokenizer.of(tok_dir)
    data = _jsonl(tmp_path / "chats.jsonl", CONVERSATIONS)
    assert chat.is_chat(data, "messages") and not chat.is_chat(data, "conversation")
    cache, reused = chat.tokenize(data, tok, cache_dir=str(tmp_path / "cache"), workers=1, progress=False)
    assert not reused and chat.tokenize(data, tok, cache_dir=str(tmp_path / "cache"), progress=False)[1]
    loaded = tok.load()
    want_ids, want_mask, starts = [], [], []
    for conv in CONVERSATIONS:
        ids, mask = chat.render(loaded, conv, CHATML)
        starts.append(len(want_ids))
        want_ids += ids + [loaded.eos_token_id]
        want_mask += mask + [0]
    corpus = corpus_of(cache)
    assert corpus.tokens(0, corpus.length).tolist() == want_ids and corpus.documents.tolist() == starts
    assert np.asarray(corpus.answers).tolist() == want_mask
    # a parquet file of the same rows is the same tokens
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"turns": CONVERSATIONS}), tmp_path / "chats.parquet")
    other, _ = chat.tokenize(str(tmp_path / "chats.parquet"), tok, messages_field="turns",
                             cache_dir=str(tmp_path / "cache"), workers=1, progress=False)
    assert other.folder != cache.folder and np.array_equal(chat.answers(other), corpus.answers)
    # and so is a saved dataset's
    from datasets import Dataset
    Dataset.from_dict({"messages": CONVERSATIONS}).save_to_disk(str(tmp_path / "saved"))
    assert chat.is_chat(str(tmp_path / "saved"))
    saved, _ = chat.tokenize(str(tmp_path / "saved"), tok, cache_dir=str(tmp_path / "cache"), workers=1, progress=False)
    assert np.array_equal(saved.tokens, corpus.tokens(0, corpus.length)) and np.array_equal(chat.answers(saved),
                                                                                            corpus.answers)
    # another template is another cache
    (tmp_path / "plain.jinja").write_text(PLAIN.replace("raise_exception('no system messages')", "''"))
    third, _ = chat.tokenize(data, tok, template_file=str(tmp_path / "plain.jinja"), cache_dir=str(tmp_path / "cache"),
                             workers=1, progress=False)
    assert third.folder not in (cache.folder, other.folder)
    # --loss-on: chat data defaults to the answers; `all` drops the mask
    assert chat.loss_on(corpus, None, None)[2] == "assistant" and chat.loss_on(corpus, None, "all")[0].answers is None
    # labels: the answer tokens' own, -100 elsewhere; with packed documents the first token of each stays -100
    for seq_len in (20, 64):
        _whole_conversations(corpus, seq_len)


def _whole_conversations(corpus, seq_len: int) -> None:
    """Every conversation is in one sequence, whole (its last seq_len tokens where it is longer), the sequences of
    an epoch hold each once, labels are its answer tokens' (the first of each -100 with packed documents), and the
    rest of a sequence is padding (EOS, label -100, its own positions from 0)."""
    from autosp.run.data import bins
    starts = np.append(corpus.documents, corpus.length)
    docs = [(corpus.tokens(max(a, b - seq_len), b), np.asarray(corpus.answers[max(a, b - seq_len):b], bool))
            for a, b in zip(starts[:-1], starts[1:])]
    n = corpus.sequences(seq_len)
    assert bins(corpus, seq_len)[2] == sum(b - a > seq_len for a, b in zip(starts[:-1], starts[1:]))
    for packing in ("concat", "docs"):
        ids, labels, pos = batch_inputs(corpus, seq_len=seq_len, batch=n, step=0, seed=0, packing=packing)
        seen = []
        for r in range(n):
            at, row = 0, []
            while at < seq_len and pos is not None and (at == 0 or pos[r, at] == 0):
                k = next((i for i, (t, _) in enumerate(docs) if i not in seen and len(t) <= seq_len - at
                          and np.array_equal(ids[r, at:at + len(t)], t)), None)
                if k is None:
                    break
                t, keep = docs[k]
                want = np.where(keep, t, -100)
                if packing == "docs" and at > 0:
                    want[0] = -100
                assert np.array_equal(labels[r, at:at + len(t)], want), (r, k)
                assert np.array_equal(pos[r, at:at + len(t)], np.arange(len(t)))
                seen.append(k)
                row.append(k)
                at += len(t)
            if pos is not None:
                assert row, r
                assert (ids[r, at:] == corpus.eos).all() and (labels[r, at:] == -100).all()
                assert np.array_equal(pos[r, at:], np.arange(seq_len - at))
        if pos is not None:
            assert sorted(seen) == list(range(len(docs)))          # each conversation once in an epoch
        else:                                                       # concat: the same rows, positions not given
            assert np.array_equal(ids, batch_inputs(corpus, seq_len=seq_len, batch=n, step=0, seed=0,
                                                    packing="docs")[0])


# ---------------------------------------------------------------- the loss on the answers, exact against one device

def _chat_corpus(seed: int, tokens: int = 1200, answers: bool = True) -> Corpus:
    """Conversations as the cache holds them, made up: documents of 6 to 40 tokens (vocab 64, EOS 0), each a prompt
    and then an answer of 0 to half its length; every third sequence of 45 or 50 tokens wholly without answers."""
    rng = np.random.default_rng(seed)
    ids, mask, starts = [], [], []
    while len(ids) < tokens:
        n = int(rng.integers(6, 40))
        starts.append(len(ids))
        ids += rng.integers(1, 64, n - 1).tolist() + [0]
        a = int(rng.integers(0, n // 2 + 1))
        mask += [0] * (n - a) + [1] * a
    ids, mask = np.asarray(ids[:tokens], dtype=np.int64), np.asarray(mask[:tokens], dtype=np.uint8)
    for seq_len in (45, 50):
        for k in range(0, tokens // seq_len, 3):
            mask[k * seq_len:(k + 1) * seq_len] = 0
    if not answers:
        mask[:] = 0
    return Corpus("chat", tokens, 63, _array=ids, documents=np.asarray(starts, dtype=np.int64), eos=0, answers=mask)


# (name, sp, dp, seq_len, global batch, grad_accum): lengths that sp does not divide
CASES = [("sp2", 2, 1, 45, 4, 2), ("sp4", 4, 1, 50, 2, 1), ("dp2xsp2", 2, 2, 45, 4, 2)]


def _step_number(corpus, case) -> int:
    """A step whose micro-batches (of every dp rank) hold unequal answer counts, one of them none, and an answer
    that straddles an edge between sp ranks' shards."""
    _, sp, dp, seq_len, batch, accum = case
    for n in range(50):
        _, labels, _ = batch_inputs(corpus, seq_len=seq_len, batch=batch, step=n, seed=0, packing="docs")
        k = batch // (dp * accum)
        counts = [int((labels[g * k:(g + 1) * k, 1:] != -100).sum()) for g in range(dp * accum)]
        chunk = -(-seq_len // sp)                    # each sp rank's tokens: the edges at multiples of it
        straddle = any(((labels[:, e - 1] != -100) & (labels[:, e] != -100)).any()
                       for e in range(chunk, seq_len, chunk))
        if straddle and sum(counts) > 0 and (len(counts) == 1 or (0 in counts and len(set(counts)) > 1)):
            return n
    raise AssertionError("no such step")


def _chat_ranks(rank, world, cases):
    """Each case of this world through the train loop's own functions (micro_batches, with_divisor,
    accumulated_step, token_mean_loss, evaluate), against one device's mean over every answer token of the global
    batch."""
    from torch.distributed.device_mesh import init_device_mesh

    import autosp
    from autosp.run.config import Step
    from autosp.run.plan import step_loss
    from autosp.run.token_mean import accumulated_step, label_count, token_mean_loss, with_divisor
    from autosp.run.train import evaluate, micro_batches
    from tests.models import params_of, rank_errors, reference, tiny_llama
    torch.manual_seed(0)
    model = tiny_llama(vocab=64)
    out = {}
    for name, sp, dp, seq_len, batch, accum, n, seed, answers in cases:
        mesh = (init_device_mesh("cpu", (sp,), mesh_dim_names=("sp",)) if dp == 1 else
                init_device_mesh("cpu", (dp, sp), mesh_dim_names=("dp", "sp")))
        corpus = _chat_corpus(seed, answers=answers)
        step = Step(model="tiny", sp=sp, dp=dp, seq_len=seq_len, batch=batch, grad_accum=accum, packing="docs")
        micro = micro_batches(corpus, step, n=n, seed=0, part=(rank // sp, dp), dev=torch.device("cpu"))
        counts = [label_count(labels) for _, labels, _ in micro]
        params = {k: torch.nn.Parameter(v) for k, v in params_of(model).items()}
        step_fn = autosp.value_and_grad(token_mean_loss(model), mesh)
        loss = accumulated_step(step_fn, params, with_divisor(micro, sp, dp))
        grads = {k: p.grad for k, p in params.items()}
        if name == "dp2xsp2":            # --eval-every's held-out loss: the mean over two batches' answers
            held = evaluate(step_fn.sharded, params, corpus, step, batches=2, seed=0, part=(rank // sp, dp),
                            dev=torch.device("cpu"))
            both = [torch.from_numpy(np.concatenate(x)) for x in zip(*(
                batch_inputs(corpus, seq_len=seq_len, batch=step.rank_batch * dp, step=b, seed=0, packing="docs")
                for b in range(2)))]
            with torch.no_grad():
                want = float(step_loss(model, params_of(model), *both))
            out["eval"] = {"errors": {"eval loss": abs(held - want) / want}, "counts": []}
        ids, labels, pos = (torch.from_numpy(x) for x in batch_inputs(corpus, seq_len=seq_len, batch=batch, step=n,
                                                                        seed=0, packing="docs"))
        if answers:
            ref_loss, ref_grads = reference(lambda p, *a: step_loss(model, p, *a), params_of(model), ids, labels, pos)
        else:                    # no answer token in the whole batch: 0, not one device's 0 / 0
            ref_loss, ref_grads = torch.tensor(0.0), {k: torch.zeros_like(v) for k, v in params.items()}
            assert float(loss) == 0.0 and all(float(g.abs().max()) == 0.0 for g in grads.values())
        errs = rank_errors(loss, grads, ref_loss, ref_grads) if answers else {"loss": float(loss)}
        out[name] = {"errors": errs, "counts": counts}
    return out


def test_the_loss_is_the_mean_over_the_global_batchs_answers_at_sp_2_4_and_dp_2():
    from tests.dist import run_ranks
    from tests.models import assert_every_rank
    by_world = {}
    for seed, case in enumerate(CASES):
        name, sp, dp, seq_len, batch, accum = case
        n = _step_number(_chat_corpus(seed), case)
        by_world.setdefault(sp * dp, []).append((name, sp, dp, seq_len, batch, accum, n, seed, True))
    by_world[4].append(("no answers", 4, 1, 50, 2, 1, 0, 1, False))     # the sp 4 case's shapes: compiled once
    for world, cases in by_world.items():
        reports = run_ranks(_chat_ranks, world, cases)
        assert_every_rank([{k: v["errors"] for k, v in r.items()} for r in reports])
        for name, *_ in cases:
            if name == "dp2xsp2":        # the dp ranks held unequal answer counts, a micro-batch none
                mine = [reports[r][name]["counts"] for r in (0, 2)]
                assert mine[0] != mine[1] and 0 in mine[0] + mine[1], mine


# ---------------------------------------------------------------- bad rows, and the command line end to end

def _model(folder, tok_dir=None, template=CHATML) -> str:
    """A tiny Llama's config.json (vocab 128) with a chat tokenizer beside it."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "max_position_embeddings": 256, "tie_word_embeddings": False}, f)
    chat_tokenizer(template).save_pretrained(str(folder))
    return str(folder)


def test_bad_rows_exit_2_naming_the_row_and_the_fix_and_write_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, bare = _model(tmp_path / "model"), _model(tmp_path / "bare", template=None)
    cache, run = tmp_path / "cache", tmp_path / "run"
    good = CONVERSATIONS[0]
    files = {
        "nofield": [{"messages": good}, {"text": "hello", "id": 2}],
        "empty": [{"messages": good}, {"messages": good}, {"messages": []}],
        "role": [{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}],
        "content": [{"messages": good}, {"messages": [{"role": "user", "content": ["hi", "there"]}]}],
        "good": [{"messages": c} for c in CONVERSATIONS],
    }
    for name, rows in files.items():
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "plain.jinja").write_text(PLAIN)
    (tmp_path / "last.jinja").write_text("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}{% if loop.last %}"
                                         " the end{% endif %} .\n{% endfor %}")
    (tmp_path / "doc.jsonl").write_text(json.dumps({"text": "the sky is blue"}) + "\n")

    def train(data, *extra, at=model):
        return ["train", "--model", at, "--data", str(tmp_path / data), "--cache-dir", str(cache), "--seq-len", "16",
                "--out", str(run), *extra]
    cases = [
        (train("nofield.jsonl"), "nofield.jsonl line 2: no field 'messages' (it has 'text', 'id'). Fix:"),
        (train("empty.jsonl"), "empty.jsonl line 3: its 'messages' is empty. Fix:"),
        (train("role.jsonl"), "role.jsonl line 1: message 2 has role 'bot', not one of system, developer, user, "
                              "assistant, tool. Fix: rename the role"),
        (train("content.jsonl"), "content.jsonl line 2: message 1's content is a list, not text. Fix:"),
        (train("good.jsonl", "--chat-template", str(tmp_path / "plain.jinja")),
         "good.jsonl line 1: the chat template fails on it (TemplateError: no system messages). Fix:"),
        (train("good.jsonl", "--chat-template", str(tmp_path / "last.jinja")),
         "good.jsonl line 1: the answer of message 3 (assistant) cannot be found in the tokens"),
        (train("good.jsonl", at=bare), "it has no chat template to render the conversations with. Fix: a tokenizer "
                                       "that has one (an instruct model's), or --chat-template FILE"),
        (train("good.jsonl", "--chat-template", str(tmp_path / "missing.jinja")), "--chat-template"),
        (train("doc.jsonl", "--loss-on", "assistant"), "is text, with no assistant answers to keep. Fix:"),
        (["eval", "--model", "tiny", "--data", str(tmp_path / "good.jsonl"), "--tokenizer", model, "--cache-dir",
          str(cache)], "a preset, with no run or model folder to write eval.json and its PNGs into. Fix: --out DIR"),
    ]
    for argv, hint in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert hint in err and "Fix:" in err, (hint, err)
    assert not run.exists()
    assert not cache.exists() or os.listdir(cache) == []          # no cache, not even a half-written one
    assert not any(n.startswith(("eval", "passkey")) for n in os.listdir(tmp_path))


def test_train_on_chat_jsonl_at_sp2_then_eval_writes_into_the_run(tmp_path, monkeypatch, capfd):
    """`autosp train` launched at sp 2; then `autosp eval` on its run folder as one rank of a user's torchrun runs
    it (in this process: no second launch), from a working folder that must stay empty."""
    from autosp.run.models import build_model, model_config
    from autosp.run.plan import step_loss
    from tests.dist import _free_port
    from tests.test_cli import launched, losses
    model, cache, run = _model(tmp_path / "model"), tmp_path / "cache", tmp_path / "run"
    data = _jsonl(tmp_path / "chats.jsonl", CONVERSATIONS * 6)
    common = ["--data", data, "--cache-dir", str(cache), "--seq-len", "45", "--timeout", "120"]
    rc, stdout, stderr, _ = launched(["train", "--model", model, *common, "--sp", "2", "--batch", "2", "--steps", "2",
                                      "--out", str(run)])
    assert rc == 0, stderr
    # the first step's loss: one device's mean over the answer tokens of the global batch, at the initial weights
    corpus = corpus_of(chat.find(data, text.Tokenizer.of(model), "messages", None, str(cache)))
    ids, labels, pos = (torch.from_numpy(x) for x in batch_inputs(corpus, seq_len=45, batch=2, step=0, seed=0,
                                                                    packing="docs"))
    assert ((labels != -100) & (labels != ids)).sum() == 0 and (labels == -100).sum() > (labels != -100).sum()
    net = build_model(model_config(model), seed=0, device="cpu")
    with torch.no_grad():
        want = float(step_loss(net, dict(net.named_parameters()), ids, labels, pos))
    got = losses(run)
    assert len(got) == 2 and abs(got[0] - want) <= 1e-5 * abs(want), (got, want)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(key, value)
    import faulthandler
    import signal
    try:
        assert main(["eval", "--model", str(run), *common, "--sp", "1", "--batches", "2"]) == 0
    finally:                           # the rank's SIGUSR1 stack dump (cli._worker), not the test session's
        faulthandler.unregister(signal.SIGUSR1)
    stdout = capfd.readouterr().out
    result = json.loads((run / "eval.json").read_text())
    assert result["loss_on"] == "assistant" and result["loss"] > 0 and "the assistant's answers" in stdout, stdout
    assert (run / "eval.png").is_file() and os.listdir(cwd) == []          # nothing in the working folder


def test_concat_packed_chat_counts_its_labels_apart_from_the_ids(tmp_path):
    """Chat data's labels are the answers only, a tensor of their own beside the ids: the step's token bytes (what
    train's prediction adds to the plan's peak) count both; text's labels are its ids."""
    from autosp.cli import check_train, parser
    model = _model(tmp_path / "model")
    chats = _jsonl(tmp_path / "chats.jsonl", CONVERSATIONS * 6)
    common = ["--model", model, "--cache-dir", str(tmp_path / "cache"), "--seq-len", "45", "--sp", "2", "--batch",
              "2", "--packing", "concat", "--out", str(tmp_path / "run")]
    a = parser().parse_args(["train", "--data", chats, *common])
    check_train(a)
    assert a.step.labels_apart and a.step.token_bytes() == 2 * 8 * 2 * 45
    a = parser().parse_args(["train", "--data", chats, "--loss-on", "all", *common])
    check_train(a)
    assert not a.step.labels_apart and a.step.token_bytes() == 8 * 2 * 45
