"""Text in: documents from JSONL, Parquet, text files, folders and saved datasets, tokenized once into a cache with
document boundaries; packing; RoPE scaling on the config; the bad inputs, each with its fix and nothing written."""
from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from autosp.cli import main
from autosp.errors import AutospError
from autosp.run import text
from autosp.run.data import Corpus, batch_inputs

DOCS = ["The grass is green.", "A second document, longer than the first one by a little.", "",
        "Third: it has numbers 12345 and symbols {}[]."]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    """A small BPE tokenizer with an EOS token, saved as transformers saves a fast tokenizer."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from extend_context import tokenizer
    folder = tmp_path_factory.mktemp("tok")
    tokenizer(DOCS * 20, vocab=300).save_pretrained(str(folder))
    return str(folder)


def _jsonl(path, docs, field="text"):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": 1}) + "\n")
    return str(path)


def test_tokens_are_the_tokenizers_with_eos_between_documents_and_the_cache_is_reused(tok_dir, tmp_path):
    from transformers import AutoTokenizer
    data = _jsonl(tmp_path / "d.jsonl", DOCS)
    tok = text.Tokenizer.of(tok_dir)
    cache, reused = text.tokenize(data, tok, cache_dir=str(tmp_path / "cache"), workers=2, progress=False)
    assert not reused
    ref = AutoTokenizer.from_pretrained(tok_dir)
    want, starts = [], []
    for d in DOCS:
        starts.append(len(want))
        want += ref(d, add_special_tokens=False)["input_ids"] + [ref.eos_token_id]
    assert cache.tokens.tolist() == want and cache.starts.tolist() == starts
    assert cache.meta["documents"] == len(DOCS) and cache.meta["eos"] == ref.eos_token_id
    again, reused = text.tokenize(data, tok, cache_dir=str(tmp_path / "cache"), progress=False)
    assert reused and again.folder == cache.folder
    # another file, field or tokenizer is another cache; a touched file too
    os.utime(data, ns=(1, 1))
    assert text.find(data, tok, "text", str(tmp_path / "cache")) is None
    # the same documents from every kind of source
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "d.parquet")
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in DOCS)
    Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "folder").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "folder" / f"{i}.txt").write_text(d)
    assert list(text.documents(str(tmp_path / "d.parquet"), "body")) == DOCS
    assert list(text.documents(str(tmp_path / "d.jsonl.gz"))) == DOCS
    assert list(text.documents(str(tmp_path / "saved"))) == DOCS
    assert list(text.documents(str(tmp_path / "folder"))) == DOCS


def test_the_cache_key_covers_the_tokenizers_config_the_libraries_and_the_format(tok_dir, tmp_path, monkeypatch):
    """Two GPT-2 tokenizers that differ only in add_prefix_space (tokenizer_config.json; tokenizer.json is the same
    file) make different ids: they are two caches, each with its own tokenizer's ids. Other transformers or
    tokenizers versions, or another CACHE_FORMAT, are another key too."""
    import shutil

    from transformers import AutoTokenizer
    data = _jsonl(tmp_path / "d.jsonl", DOCS)
    folders = []
    for prefix in (False, True):
        folder = tmp_path / f"prefix-{prefix}"
        shutil.copytree(tok_dir, folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.update(tokenizer_class="GPT2Tokenizer", add_prefix_space=prefix)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        folders.append(str(folder))
    assert (tmp_path / "prefix-False" / "tokenizer.json").read_bytes() == \
        (tmp_path / "prefix-True" / "tokenizer.json").read_bytes()
    caches = [text.tokenize(data, text.Tokenizer.of(f), cache_dir=str(tmp_path / "cache"), workers=1,
                            progress=False) for f in folders]
    assert not caches[1][1] and caches[0][0].folder != caches[1][0].folder
    for folder, (cache, _) in zip(folders, caches):
        ref = AutoTokenizer.from_pretrained(folder)
        first = ref(DOCS[0], add_special_tokens=False)["input_ids"] + [ref.eos_token_id]
        assert cache.tokens[:len(first)].tolist() == first
    assert caches[0][0].tokens.tolist() != caches[1][0].tokens.tolist()     # the prefix space made other ids
    tok = text.Tokenizer.of(folders[0])
    key, versions = text.cache_key(data, tok, "text"), text.library_versions()
    bumped = [versions.replace(f"{lib} ", f"{lib} 9") for lib in ("transformers", "tokenizers")]
    assert len(set(bumped)) == 2 and versions not in bumped
    changes = [("library_versions", lambda v=v: v) for v in bumped] + [("CACHE_FORMAT", text.CACHE_FORMAT + 1)]
    for name, value in changes:
        with monkeypatch.context() as m:
            m.setattr(text, name, value)
            assert text.cache_key(data, tok, "text") != key, name
    assert text.cache_key(data, tok, "text") == key


def test_text_that_is_not_utf8_is_an_error_naming_the_file_and_the_byte(tmp_path):
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("Grüße aus Köln".encode("latin-1"))
    with pytest.raises(AutospError, match=r"latin1\.txt: not UTF-8 text: byte 2 is 0xfc \(invalid start byte\)\. "
                                          r"Fix: convert the file to UTF-8"):
        list(text.documents(str(latin)))
    lines = tmp_path / "latin1.jsonl"
    lines.write_bytes(b'{"text": "fine"}\n' + '{"text": "Grüße"}\n'.encode("latin-1"))
    with pytest.raises(AutospError, match=r"latin1\.jsonl: line 2 is not UTF-8 text: its byte 12 is 0xfc .*Fix:"):
        list(text.documents(str(lines)))
    cache = tmp_path / "cache"
    with pytest.raises(AutospError, match="not UTF-8"):       # nothing cached, not even half a cache
        text.tokenize(str(latin), text.Tokenizer("bytes"), cache_dir=str(cache), workers=1, progress=False)
    assert os.listdir(cache) == []


def test_packed_documents_restart_their_positions_and_are_not_predicted_across(tmp_path):
    # a stream of documents of 3, 5, 9 and 7 tokens (EOS last in each), sequences of 8
    lengths = [3, 5, 9, 7]
    starts = np.cumsum([0] + lengths[:-1])
    tokens = np.arange(sum(lengths)) % 50 + 1
    corpus = Corpus("docs", len(tokens), 60, _array=tokens, documents=starts, eos=0)
    ids, labels, pos = batch_inputs(corpus, seq_len=8, batch=3, step=0, seed=0, packing="docs")
    rows = [int(r[0] - 1) // 8 for r in ids]                    # which sequence each row is (tokens are 1 + index)
    for r, k in enumerate(rows):
        idx = np.arange(k * 8, k * 8 + 8)
        doc = np.searchsorted(starts, idx, side="right") - 1
        begin = np.maximum(starts[doc], k * 8)                  # a document cut by the sequence starts at its start
        assert pos[r].tolist() == (idx - begin).tolist()
        cut = (idx == starts[doc]) & (idx > k * 8)
        assert (labels[r][cut] == -100).all() and (labels[r][~cut] == ids[r][~cut]).all()
    plain = batch_inputs(corpus, seq_len=8, batch=3, step=0, seed=0, packing="concat")
    assert plain[2] is None and (plain[1] == plain[0]).all() and (plain[0] == ids).all()
    # a held-out part: the last tokens, documents starting anew where it begins
    tail = corpus.part(16, 24, "tail")
    assert tail.tokens(0, 8).tolist() == tokens[16:24].tolist() and tail.documents.tolist() == [0, 1]


def test_rope_scaling_raises_the_positions_and_is_in_the_config():
    from autosp.run.models import model_config, parse_rope_scaling, rope_of
    spec = model_config("tiny", rope_scaling="yarn:4", rope_theta=50000)
    rope = rope_of(spec.config)
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["rope_theta"] == 50000.0
    assert rope["original_max_position_embeddings"] == 131072 and spec.config.max_position_embeddings == 4 * 131072
    for kind in ("linear", "dynamic", "llama3"):
        assert rope_of(model_config("tiny", rope_scaling=f"{kind}:2").config)["rope_type"] == kind
    for bad in ("yarn", "yarn:1", "cubic:4", "yarn:x"):
        with pytest.raises(AutospError, match=r"--rope-scaling .*Fix: --rope-scaling yarn:4"):
            parse_rope_scaling(bad)


def test_bad_text_exits_2_with_the_fix_and_writes_nothing(tok_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "cache"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256}))
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text((model / "config.json").read_text().replace('"vocab_size": 512',
                                                                                   '"vocab_size": 100'))
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "nocol.parquet")
    base = ["train", "--model", str(model), "--tokenizer", tok_dir, "--cache-dir", str(cache), "--seq-len", "16",
            "--out", str(tmp_path / "run")]
    cases = [
        (base + ["--data", str(no_field)], "line 2 has no field 'text' (it has 'body'). Fix: --text-field"),
        (base + ["--data", str(empty)], "no documents. Fix:"),
        (base + ["--data", str(tmp_path / "nocol.parquet")], "no column 'text' (columns: body). Fix: --text-field"),
        (["train", "--model", str(small), "--tokenizer", tok_dir, "--data", str(no_field), "--seq-len", "16",
          "--cache-dir", str(cache), "--out", str(tmp_path / "run")], "more than the model's vocabulary of 100"),
        (["train", "--model", str(model), "--data", str(no_field), "--seq-len", "16", "--out", str(tmp_path / "run")],
         "the model has no tokenizer. Fix: --tokenizer"),
        (base + ["--data", str(tmp_path / "missing.jsonl")], "no such file or folder"),
        (base + ["--data", str(no_field), "--packing", "docs", "--text-field", "body"], "line 1 has no field 'body'"),
    ]
    for argv, hint in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert hint in err and "Fix:" in err, (argv, err)
    assert not (tmp_path / "run").exists()
    assert not cache.exists() or os.listdir(cache) == []          # no cache, not even a half-written one
    with pytest.raises(AutospError, match="not a folder with a tokenizer's files"):
        text.Tokenizer.of(str(tmp_path))


def test_a_length_beyond_the_positions_without_scaling_is_warned(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}))
    # refused afterwards for its memory (nothing runs); the warning came first
    assert main(["train", "--model", str(model), "--seq-len", "200", "--memory", "1KiB",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--seq-len 200 is beyond the model's 64 positions and no --rope-scaling is set. Fix: --rope-scaling " \
           "yarn:4" in err, err
