"""Chat data: conversations rendered by the tokenizer's own chat template into the token cache, with a mask of the
tokens that are the assistant's answers.

    chat.is_chat("chats.jsonl", "messages")         # the rows hold a `messages` column: chat data
    cache, reused = chat.tokenize("chats.jsonl", Tokenizer.of("models/llama"), messages_field="messages")
    cache.tokens, cache.starts, answers(cache)      # tokens, document starts, uint8 1 on each answer token

A row is a conversation: a list of {"role", "content"} messages (roles system, developer, user, assistant, tool;
content a string) in a JSONL line's, a Parquet row's or a saved dataset row's `messages` column (--messages-field
names another). Each conversation is one document of the cache: its text as the template renders it (the template
writes its own special tokens, so it is tokenized without adding any), followed by the tokenizer's EOS unless the
template ends with it. The answer of assistant turn i is found for any template, with or without `{% generation %}`
blocks: the tokens between the conversation up to turn i rendered with the generation prompt and the conversation
up to turn i rendered with it, both of which must be prefixes of the whole conversation's tokens (a template that
renders earlier turns otherwise, or a merge of tokens across the boundary, is an error naming the row). The mask
lives beside the tokens (answers.bin); the cache key covers the messages field, the template and CHAT_FORMAT.

`--loss-on assistant` (the default for chat data) keeps the labels of the answer tokens only (data.batch_inputs
reads the mask); `--loss-on all` trains on every token. Text data has no answers: `--loss-on assistant` on it is an
error.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from typing import Iterator

import numpy as np

from autosp.errors import AutospError
from autosp.run import text

ROLES = ("system", "developer", "user", "assistant", "tool")
CHAT_FORMAT = 1                 # the chat cache's layout (answers.bin) and what its mask means
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")   # where save_pretrained keeps the template
_ROWS_PER_BATCH = 256
_SHAPE = 'rows of {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'


# ---------------------------------------------------------------- which data is chat

def _first_row_fields(source: str) -> list[str] | None:
    """The fields (columns) of a source's first row, None for a .txt file or an empty one."""
    if os.path.isdir(source):
        from datasets import Dataset, load_from_disk
        ds = load_from_disk(source)
        return list(ds.column_names) if isinstance(ds, Dataset) else None
    if source.endswith(".parquet"):
        import pyarrow.parquet as pq
        return list(pq.read_schema(source).names)
    if source.endswith((".jsonl", ".jsonl.gz")):
        import gzip
        opener = gzip.open if source.endswith(".gz") else open
        with opener(source, "rb") as f:
            for raw in f:
                if raw.strip():
                    try:
                        row = json.loads(raw)
                    except ValueError:
                        return None                 # text.py's reader names the line
                    return list(row) if isinstance(row, dict) else None
    return None


def is_chat(path: str, messages_field: str = "messages") -> bool:
    """Whether `--data PATH` is conversations: its sources' first rows hold `messages_field`. A mix of chat and text
    sources is an error (one run trains on one kind)."""
    if path is None or not (os.path.isdir(path) or path.endswith(text.TEXT_SUFFIXES)):
        return False
    kinds = {}
    for source in text.sources(path):
        fields = _first_row_fields(source)
        kinds[source] = fields is not None and messages_field in fields
    if len(set(kinds.values())) > 1:
        chat = next(s for s, k in kinds.items() if k)
        plain = next(s for s, k in kinds.items() if not k)
        raise AutospError(f"--data {path}: {chat} holds conversations ({messages_field!r}) and {plain} does not. "
                          "Fix: point --data at one kind of data (a folder of chat files, or of text files).")
    return bool(kinds) and all(kinds.values())


# ---------------------------------------------------------------- conversations, checked

def _check(where: str, messages, field: str) -> list[dict]:
    """The conversation of one row, or AutospError naming the row and the fix."""
    if not isinstance(messages, list) or not messages:
        what = "empty" if isinstance(messages, list) else f"a {type(messages).__name__}, not a list of messages"
        raise AutospError(f"--data {where}: its {field!r} is {what}. Fix: {_SHAPE} (at least one message), or remove "
                          "the row.")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise AutospError(f"--data {where}: message {i} is not a {{\"role\", \"content\"}} object ({str(m)[:80]}). "
                              f"Fix: {_SHAPE}.")
        if m["role"] not in ROLES:
            raise AutospError(f"--data {where}: message {i} has role {m['role']!r}, not one of {', '.join(ROLES)}. "
                              "Fix: rename the role (e.g. 'human' -> 'user', 'gpt' -> 'assistant').")
        if not isinstance(m["content"], str):
            raise AutospError(f"--data {where}: message {i}'s content is a {type(m['content']).__name__}, not text. "
                              "Fix: the content as one string (join a list of parts' text).")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def conversations(path: str, field: str = "messages") -> Iterator[tuple[str, list[dict]]]:
    """(where, messages) of every row of `--data PATH`, in order, each checked as it is read; `where` names the
    file and the line (JSONL) or row (Parquet, a saved dataset)."""
    for source in text.sources(path):
        if os.path.isdir(source):
            from datasets import Dataset, load_from_disk
            ds = load_from_disk(source)
            if not isinstance(ds, Dataset) or field not in ds.column_names:
                raise AutospError(f"--data {source}: no column {field!r}. Fix: --messages-field with the column that "
                                  "holds the conversations.")
            for n, row in enumerate(ds.select_columns([field]), 1):
                yield f"{source} row {n}", _check(f"{source} row {n}", row[field], field)
        elif source.endswith(".parquet"):
            import pyarrow.parquet as pq
            n = 0
            for batch in pq.ParquetFile(source).iter_batches(columns=[field], batch_size=1024):
                for messages in batch.column(0).to_pylist():
                    n += 1
                    yield f"{source} row {n}", _check(f"{source} row {n}", messages, field)
        elif source.endswith((".jsonl", ".jsonl.gz")):
            import gzip
            opener = gzip.open if source.endswith(".gz") else open
            with opener(source, "rb") as f:
                for n, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    where = f"{source} line {n}"
                    try:
                        row = json.loads(raw.decode("utf-8"))
                    except (UnicodeDecodeError, ValueError) as exc:
                        raise AutospError(f"--data {where}: not a JSON object in UTF-8 ({exc}). Fix: one JSON object "
                                          "per line, written as UTF-8.") from None
                    if not isinstance(row, dict) or field not in row:
                        keys = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
                        raise AutospError(f"--data {where}: no field {field!r} (it has {keys}). Fix: {_SHAPE}, or "
                                          "--messages-field with the field that holds the conversation.")
                    yield where, _check(where, row[field], field)
        else:
            raise AutospError(f"--data {source}: a {os.path.splitext(source)[1]} file among conversations. Fix: chat "
                              "data as .jsonl, .parquet or a saved dataset.")


# ---------------------------------------------------------------- the template

def template_of(tok, tokenizer: text.Tokenizer, template_file: str | None) -> str:
    """The Jinja chat template: --chat-template FILE, else the tokenizer's own; AutospError with the fix if none."""
    if template_file is not None:
        if not os.path.isfile(template_file):
            raise AutospError(f"--chat-template {template_file}: no such file. Fix: a file holding a Jinja chat "
                              "template (as tokenizer.chat_template holds it).")
        with open(template_file, encoding="utf-8") as f:
            return f.read()
    found = getattr(tok, "chat_template", None)
    if isinstance(found, dict):                       # named templates: the default one renders conversations
        found = found.get("default")
    if not found:
        raise AutospError(f"--tokenizer {tokenizer.path}: it has no chat template to render the conversations with. "
                          "Fix: a tokenizer that has one (an instruct model's), or --chat-template FILE with a Jinja "
                          "chat template.")
    return found


def template_digest(tokenizer: text.Tokenizer, template_file: str | None) -> str:
    """What identifies the template without loading the tokenizer (every rank asks): the --chat-template file's
    bytes, else the tokenizer folder's template files (tokenizer_config.json is in Tokenizer.digest already)."""
    h = hashlib.sha256()
    files = [template_file] if template_file else [os.path.join(tokenizer.path, n) for n in _TEMPLATE_FILES]
    for file in files:
        if os.path.isfile(file):
            with open(file, "rb") as f:
                h.update(f"\0{os.path.basename(file)}\0".encode() + f.read())
    return h.hexdigest()


class RenderError(AutospError):
    """A conversation the template fails on, or whose answers cannot be found in its tokens."""


def render(tok, messages: list[dict], template: str, where: str = "conversation") -> tuple[list[int], list[int]]:
    """(token ids, answer mask) of one conversation: the template's rendering tokenized without special tokens, 1 on
    every token of an assistant turn's answer (what the template writes for the turn after its generation prompt)."""
    def ids_of(msgs, prompt: bool) -> list[int]:
        try:
            rendered = tok.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                               add_generation_prompt=prompt)
        except Exception as exc:  # noqa: BLE001 - any failure is the template's on this row
            raise RenderError(f"--data {where}: the chat template fails on it ({type(exc).__name__}: {exc}). Fix: a "
                              "conversation the template accepts (many require user and assistant turns to "
                              "alternate, a system message first), or another --chat-template.") from None
        return list(tok(rendered, add_special_tokens=False)["input_ids"])

    full = ids_of(messages, False)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = ids_of(messages[:i], True), ids_of(messages[:i + 1], False)
        if full[:len(before)] != before or full[:len(upto)] != upto or len(upto) < len(before):
            raise RenderError(
                f"--data {where}: the answer of message {i + 1} (assistant) cannot be found in the tokens: the "
                "conversation up to it, rendered with the generation prompt, and up to its end are not both "
                "prefixes of the whole conversation's tokens (the template renders earlier turns otherwise, or a "
                "token merges across the boundary). Fix: a template that renders each turn the same whatever "
                "follows (--chat-template FILE), or --loss-on all with text data (--text-field).")
        mask[len(before):len(upto)] = [1] * (len(upto) - len(before))
    return full, mask


# ---------------------------------------------------------------- the cache

def cache_key(path: str, tokenizer: text.Tokenizer, field: str, template_file: str | None) -> str:
    h = hashlib.sha256(text.cache_key(path, tokenizer, field).encode())
    h.update(f"\0chat {CHAT_FORMAT}\0{field}\0{template_digest(tokenizer, template_file)}".encode())
    return h.hexdigest()[:24]


def find(path: str, tokenizer: text.Tokenizer, field: str, template_file: str | None,
         cache_dir: str | None = None) -> text.TokenCache | None:
    folder = os.path.join(cache_dir or text.default_cache_dir(), cache_key(path, tokenizer, field, template_file))
    meta = os.path.join(folder, "meta.json")
    if not os.path.isfile(meta):
        return None
    with open(meta) as f:
        return text.TokenCache(folder, json.load(f))


def answers(cache: text.TokenCache) -> np.ndarray:
    """The answer mask of a chat cache: uint8 [tokens], memory-mapped."""
    return np.memmap(os.path.join(cache.folder, "answers.bin"), dtype=np.uint8, mode="r",
                     shape=(cache.meta["tokens"],))


_WORKER = {}


def _init_worker(tokenizer: text.Tokenizer, template: str) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = tokenizer.load()
    if hasattr(tok, "model_max_length"):
        tok.model_max_length = 1 << 62
    _WORKER.update(tok=tok, template=template)


def _render_rows(rows: list[tuple[str, list[dict]]]) -> list[tuple[list[int], list[int]]]:
    return [render(_WORKER["tok"], messages, _WORKER["template"], where) for where, messages in rows]


def _batches(rows):
    batch = []
    for row in rows:
        batch.append(row)
        if len(batch) >= _ROWS_PER_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _rendered(batches, tokenizer: text.Tokenizer, template: str, workers: int):
    """(rows, their (ids, mask)) per batch, in order: in `workers` processes, or here for one."""
    if workers <= 1:
        _init_worker(tokenizer, template)
        for rows in batches:
            yield rows, _render_rows(rows)
        return
    import multiprocessing as mp
    ctx = mp.get_context("fork" if hasattr(os, "fork") else "spawn")
    pending: list = []
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer, template)) as pool:
        for rows in batches:
            pending.append((rows, pool.apply_async(_render_rows, (rows,))))
            if len(pending) >= 2 * workers:
                rows0, job = pending.pop(0)
                yield rows0, job.get()
        for rows0, job in pending:
            yield rows0, job.get()


def tokenize(path: str, tokenizer: text.Tokenizer, *, messages_field: str = "messages",
             template_file: str | None = None, cache_dir: str | None = None, workers: int | None = None,
             progress: bool = True) -> tuple[text.TokenCache, bool]:
    """(the cache of the conversations of `--data PATH`, whether it was there already): tokens, document starts and
    the answer mask, written into a temporary folder renamed into place (a bad row leaves nothing behind)."""
    found = find(path, tokenizer, messages_field, template_file, cache_dir)
    if found is not None:
        return found, True
    if tokenizer.path == "bytes":
        raise AutospError(f"--data {path}: conversations, and the model reads bytes (no chat template). Fix: a model "
                          "folder with its tokenizer, or --tokenizer FOLDER with a chat template.")
    vocab, eos = tokenizer.vocab_and_eos()
    template = template_of(tokenizer.load(), tokenizer, template_file)
    root = cache_dir or text.default_cache_dir()
    key = cache_key(path, tokenizer, messages_field, template_file)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    bar = text._bar() if progress else None
    starts, count, docs, answer_tokens = [], 0, 0, 0
    try:
        with text.staged(root, key) as tmp:
            workers = workers or min(8, os.cpu_count() or 1)
            tokens, answers_file = os.path.join(tmp, "tokens.bin"), os.path.join(tmp, "answers.bin")
            rendered = _rendered(_batches(conversations(path, messages_field)), tokenizer, template, workers)
            with open(tokens, "wb") as out, open(answers_file, "wb") as ans:
                for rows, done in rendered:
                    for (where, _), (ids, mask) in zip(rows, done):
                        if not ids or ids[-1] != eos:         # documents end with EOS, as text.py's do
                            ids, mask = ids + [eos], mask + [0]
                        arr = np.asarray(ids, dtype=np.int64)
                        if int(arr.max()) >= vocab:
                            raise AutospError(f"--tokenizer {tokenizer.path}: produced id {int(arr.max())} on {where}, "
                                              f"beyond its {vocab} ids. Fix: a tokenizer whose len() covers every id.")
                        starts.append(count)
                        out.write(arr.astype(dtype).tobytes())
                        ans.write(np.asarray(mask, dtype=np.uint8).tobytes())
                        count += arr.size
                        answer_tokens += sum(mask)
                        docs += 1
                    if bar is not None:
                        bar.update(len(rows))
            if docs == 0:
                raise AutospError(f"--data {path}: no conversations. Fix: {_SHAPE}.")
            np.save(os.path.join(tmp, "starts.npy"), np.asarray(starts, dtype=np.int64))
            meta = {"tokens": count, "documents": docs, "dtype": np.dtype(dtype).name, "eos": eos, "vocab": vocab,
                    "tokenizer": tokenizer.path, "text_field": None, "sources": text.sources(path),
                    "format": text.CACHE_FORMAT, "libraries": text.library_versions(),
                    "chat": {"messages_field": messages_field, "template_file": template_file, "format": CHAT_FORMAT,
                             "answer_tokens": answer_tokens}}
            return text.TokenCache(text.publish(tmp, root, key, meta), meta), False
    finally:
        if bar is not None:
            bar.close()


# ---------------------------------------------------------------- --loss-on

def check_loss_on(a) -> None:
    """--loss-on assistant on data that is not chat: refused before anything is tokenized."""
    if getattr(a, "loss_on", None) != "assistant":
        return
    field = getattr(a, "messages_field", "messages")
    for role, path in (("--data", a.data), ("--eval-data", getattr(a, "eval_data", None))):
        if (path is not None or role == "--data") and not is_chat(path, field):
            raise AutospError(f"--loss-on assistant: {role} {path or '(the default corpus)'} is text, with no "
                              f"assistant answers to keep. Fix: chat data (rows with a {field!r} column, or "
                              "--messages-field), or --loss-on all.")


def loss_on(corpus, heldout, choice: str | None):
    """(corpus, held-out part, the choice made) with --loss-on applied: `assistant` keeps the answer mask (the
    default for chat data), `all` drops it (every token trained on); text has no answers to keep."""
    chat = corpus.answers is not None
    choice = choice or ("assistant" if chat else "all")
    if choice == "assistant" and not chat:
        raise AutospError(f"--loss-on assistant: {corpus.name} is text, with no assistant answers to keep. Fix: chat "
                          "data (rows with a 'messages' column, or --messages-field), or --loss-on all.")
    if choice == "all":
        return (replace(corpus, answers=None), None if heldout is None else replace(heldout, answers=None), choice)
    if heldout is not None and heldout.answers is None:
        raise AutospError(f"--loss-on assistant: {corpus.name} is chat data and the held-out {heldout.name} is text. "
                          "Fix: --eval-data with conversations too, or --loss-on all.")
    if not np.any(corpus.answers[corpus.offset:corpus.offset + corpus.length]):
        raise AutospError(f"--loss-on assistant: {corpus.name} holds no assistant answer. Fix: conversations with "
                          "assistant turns, or --loss-on all.")
    return corpus, heldout, choice
