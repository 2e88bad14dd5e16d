"""Keep your Trainer: a transformers Trainer script, sequence-parallel with autosp. The five lines that differ
from the script you have are marked `# autosp`; the launch is the fifth:

    torchrun --nproc-per-node 4 examples/keep_your_trainer.py --model demo/llama --data demo/docs.jsonl \\
        --seq-len 1024 --sp 2 --out runs/trainer                     # autosp: launched by torchrun

MODEL: a Hugging Face causal LM folder with its tokenizer (`python examples/extend_context.py --out demo`
writes a small one, and the documents); --data: JSONL with a "text" field. 4 ranks with --sp 2 are dp 2 x sp 2:
each rank holds seq-len / 2 of every activation, the two dp groups read different rows, and the losses are those
of the same script on one device (`python examples/keep_your_trainer.py ... --sp 1`) with twice the batch.
"""
from __future__ import annotations

import argparse
import json

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, TrainingArguments

from autosp.integrations.transformers import AutospTrainer     # autosp: was `from transformers import Trainer`


def main(argv=None, callbacks=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face causal LM folder with its tokenizer")
    p.add_argument("--data", required=True, help='JSONL, one {"text": ...} per line')
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--sp", type=int, default=1, help="ranks each sequence is split over")     # autosp
    p.add_argument("--out", default="runs/trainer")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=1, help="sequences per step and dp group")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast, as TrainingArguments(bf16=True)")
    a = p.parse_args(argv)

    tok = AutoTokenizer.from_pretrained(a.model)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation="sdpa")
    with open(a.data) as f:
        docs = Dataset.from_list([{"text": json.loads(line)["text"]} for line in f if line.strip()])
    train = docs.map(lambda rows: tok(rows["text"], truncation=True, max_length=a.seq_len,
                                      padding="max_length"),    # autosp: one length, so the step compiles once
                     batched=True, remove_columns=["text"])
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=a.batch,
                             gradient_accumulation_steps=a.grad_accum, learning_rate=a.lr, max_grad_norm=1.0,
                             logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
                             bf16=a.bf16,
                             use_cpu=not torch.cuda.is_available())    # on CPU, torchrun's ranks need it (gloo)
    trainer = AutospTrainer(model=model, args=args, train_dataset=train,      # autosp: the class
                            data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                            callbacks=callbacks, sp=a.sp)                     # autosp: the sp degree
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
