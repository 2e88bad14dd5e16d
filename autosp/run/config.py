"""What a training step is, parsed in one place for `autosp plan | train | explain`.

    p = argparse.ArgumentParser(); add_step_flags(p, "train")
    step = step_of(p.parse_args(argv), "train")      # a Step: validated, defaults resolved
    step.argv()                                      # the `autosp train` flags that reproduce it

A Step names the model, the mesh (dp x sp, a ring size), the sequence, the precision, the memory
per rank, where activations and optimizer state may go (offload, host memory), and how the state
is laid out. `plan` answers for it, `train` runs it, `explain` shows its program: each reads the same
flags through `step_of`, so a plan's answer is a command line that trains exactly what was planned.
Bad input raises AutospError with the fix before anything runs.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace

from autosp.errors import AutospError

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}
GPU_NAMES = ("a100", "b200", "h100", "h200", "mi300x")     # autosp.remat.cost.GPUS (not imported here: torch)
HOST_MEMORY = 2**40           # host memory per node when --host-memory is not given
RANKS_PER_NODE = 8            # ranks that share a node's host memory (an 8-GPU node; fewer if the run is smaller)
CPU_HOST_BANDWIDTH = 5e9      # bytes/s the cost model gives a CPU's copies into the host pool (--offload on CPU)


def positive(kind=int):
    """An argparse type: a positive `kind` (int or float)."""
    def check(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'number' if kind is float else 'whole number'}") \
                from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be positive")
        return value
    return check


def add_step_flags(p: argparse.ArgumentParser, verb: str) -> None:
    """The flags that say what the step is, the same for every verb (defaults resolved by step_of)."""
    g = p.add_argument_group("the step (the same flags for plan, train and explain)")
    g.add_argument("--model", required=verb != "train", default="tiny" if verb == "train" else None,
                   help="preset (tiny, small, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b) or a Hugging Face "
                   "config.json / model folder" + (" (default tiny)" if verb == "train" else ""))
    g.add_argument("--sp", type=positive(), default=None, help="sequence-parallel ranks (default: the launcher's "
                   "world / dp under torchrun, else the visible GPUs, else 2)")
    g.add_argument("--dp", type=positive(), default=1, help="data-parallel ranks (default 1)")
    g.add_argument("--ring", type=positive(), default=None, help="ring attention over R of the sp ranks (sp = U x "
                   "R, an all-to-all over U); default: autosp factorises (a ring only where the heads run out)")
    g.add_argument("--seq-len", type=positive(), default=None, required=verb == "explain",
                   help={"train": "tokens per sequence (default 512)",
                         "plan": "answer for this length: whether it fits, its memory and time (default: the "
                                 "longest length that fits --memory)",
                         "explain": "tokens per sequence",
                         "eval": "tokens per sequence of --data (default 512; --passkey: the longest --lengths)"}[verb])
    g.add_argument("--batch", type=positive(), default=None, help="sequences per step over all dp ranks "
                   "(default dp x grad-accum: one per dp rank and micro-step)")
    g.add_argument("--grad-accum", type=positive(), default=1, help="micro-steps per optimizer step: the batch is "
                   "split into this many, their gradients summed by token count (default 1)")
    g.add_argument("--precision", choices=sorted(PRECISIONS), default=None,
                   help="fp32, or bf16: FSDP2's mixed precision (bf16 parameters gathered and computed, fp32 master "
                        "weights and optimizer state); default bf16 on cuda, fp32 on cpu")
    g.add_argument("--reduce-dtype", choices=sorted(PRECISIONS), default="fp32",
                   help="dtype the gradients are reduced in (default fp32)")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if a GPU is visible")
    g.add_argument("--gpu", choices=sorted(GPU_NAMES), default=None,
                   help="the GPU the step is planned for (implies --device cuda): its memory (the default --memory of "
                        "plan), compute, memory and link bandwidths, and the attention kernels SDPA runs on it, whose "
                        "scratch the plan counts. Default: an H100/H200-class GPU running SDPA's cuDNN backend")
    g.add_argument("--memory", default=None, help="device memory per rank, e.g. 80GiB: plan answers the longest "
                   "length that fits it; train plans its step within it and refuses (exit 2) a length that does not fit")
    g.add_argument("--memory-budget", default=None, help="the step's remat budget: a fraction of its no-remat peak "
                   "(0.5), bytes (6GiB) or 'least'; default: what --memory leaves the step"
                   + (", else 0.5" if verb == "explain" else ", else none (autograd's saving)"))
    g.add_argument("--offload", action="store_true", help="let the plan move activations to host memory (a GPU's "
                   "pinned pool on a side stream; on CPU a host pool apart from the step's allocations)")
    g.add_argument("--host-memory", default=None, help="host memory per node, e.g. 1TiB (default: 1 TiB assumed), "
                   f"shared by its min(ranks, {RANKS_PER_NODE}) ranks: each rank's share caps what it offloads")
    g.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                   help="adamw (2 fp32 moments per parameter) or sgd (none)")
    g.add_argument("--optimizer-offload", action="store_true", help="fp32 master weights, gradient copies and "
                   "optimizer state in host memory, stepped by the CPU (ZeRO-Offload)")
    g.add_argument("--no-tile", dest="tile", action="store_false", help="never run the MLPs and the loss head in "
                   "tiles along the sequence (faster to plan, shorter at long context)")
    g.add_argument("--no-shard-params", dest="shard_params", action="store_false",
                   help="keep parameters, gradients and optimizer state whole on every rank (default with more than "
                        "one rank: split on dim 0 over all ranks, FSDP2's layout)")
    g.add_argument("--packing", choices=["docs", "concat"], default=None,
                   help="docs: documents packed into each sequence, positions restarting and attention kept inside "
                        "each (autosp's exact packed-documents path); concat: one causal sequence (default: docs for "
                        "text with document boundaries" + (", concat otherwise)" if verb == "train" else "; concat here)"))
    g.add_argument("--rope-theta", type=positive(float), default=None, help="RoPE's base (the model's by default)")
    g.add_argument("--rope-scaling", default=None, metavar="TYPE:FACTOR",
                   help="extend the context FACTOR times: linear, dynamic, yarn or llama3, as transformers' "
                        "rope_scaling (max_position_embeddings raised to match), e.g. yarn:4")
    g.add_argument("--objective", choices=["sft", "dpo"], default="sft",
                   help="sft: the next-token loss; dpo: preference pairs (prompt, chosen, rejected), each step runs "
                        "the chosen and the rejected sequence of every pair against a frozen reference (default sft)")
    g.add_argument("--beta", type=positive(float), default=0.1, help="DPO's beta: how far the policy may move from "
                   "the reference (default 0.1)")
    g.add_argument("--dtype", dest="renamed_dtype", default=None, help=argparse.SUPPRESS)
    if verb != "eval":                          # eval reads a LoRA run's adapters from its record (lora.py)
        add_lora_flags(p)


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """LoRA through peft (run/lora.py): the flags of the adapters a step trains instead of the whole model."""
    g = p.add_argument_group("LoRA (peft): train adapters, the base frozen")
    g.add_argument("--lora-r", type=positive(), default=None, help="train LoRA adapters of this rank (peft), the "
                   "base model frozen in the compute dtype: no gradient, no optimizer state (default: no LoRA)")
    g.add_argument("--lora-alpha", type=positive(float), default=None, help="the adapters' scale is alpha / r "
                   "(default 2 r, the common recipe; peft's own default is 8 whatever r)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input (default 0)")
    g.add_argument("--lora-targets", default=None, help="comma-separated names of the Linear modules to adapt "
                   "(default: every Linear of the model but its output head: q,k,v,o,gate,up,down _proj in a Llama)")


@dataclass(frozen=True)
class Step:
    """One training step's configuration (see the module docstring). `memory` and `host_memory` keep
    the text the user wrote, so that argv() gives it back as it was."""
    model: str
    sp: int = 1
    dp: int = 1
    ring: int | None = None
    seq_len: int | None = None
    batch: int | None = None            # sequences per step over all dp ranks (None: dp)
    precision: str = "fp32"
    reduce_dtype: str = "fp32"
    device: str = "cpu"
    gpu: str | None = None              # the GPU planned for (cost.GPUS); None: the default GPU model of 'cuda'
    memory: str | None = None
    memory_budget: object = None        # a fraction, bytes, 'least' or None
    offload: bool = False
    host_memory: str | None = None
    optimizer: str = "adamw"
    optimizer_offload: bool = False
    tile: bool = True
    shard_params: bool = True
    packing: str = "concat"             # docs: position ids restart per document (the step takes them)
    labels_apart: bool = False          # the labels are not the ids (chat data's answers only): one more tensor
    rope_theta: float | None = None
    rope_scaling: str | None = None     # "yarn:4"
    grad_accum: int = 1                 # micro-steps per optimizer step
    objective: str = "sft"              # "dpo": --batch counts pairs, each step runs 2 sequences per pair
    beta: float = 0.1                   # DPO's beta
    lora_r: int | None = None           # LoRA adapters of this rank (run/lora.py); None: every parameter trains
    lora_alpha: float | None = None     # resolved: 2 r
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] | None = None     # None: the model's Linear projections (lora.targets)

    # ------------------------------------------------------------ derived
    @property
    def target(self) -> str:
        """The device the plan prices each op for (cost.device_for): a GPU's name, 'cuda' or 'cpu'."""
        return self.gpu or self.device

    @property
    def world(self) -> int:
        return self.sp * self.dp

    @property
    def global_batch(self) -> int:
        return self.batch or self.dp * self.grad_accum

    @property
    def rank_batch(self) -> int:
        """Sequences each dp rank's (micro-)step takes."""
        return self.global_batch // (self.dp * self.grad_accum)

    @property
    def dtype(self):
        import torch
        return getattr(torch, PRECISIONS[self.precision])

    @property
    def grad_dtype(self):
        import torch
        return getattr(torch, PRECISIONS[self.reduce_dtype])

    @property
    def sharded(self) -> bool:
        """The model state as autosp.shard_params lays it out: over every rank; with one rank, in bf16 too, where
        the fp32 master weights are the one rank's 'shard' and the step gathers (casts) its bf16 copy. ZeRO-Offload
        on one rank keeps its fp32 masters on the host instead, the device's parameters in the compute dtype."""
        if not self.shard_params:
            return False
        return self.world > 1 or (self.precision != "fp32" and not self.optimizer_offload)

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory is None else parse_size(self.memory, "--memory")

    @property
    def host_node_bytes(self) -> int:
        return HOST_MEMORY if self.host_memory is None else parse_size(self.host_memory, "--host-memory")

    @property
    def ranks_per_node(self) -> int:
        return min(self.world, RANKS_PER_NODE)

    @property
    def host_share(self) -> int:
        """This rank's share of its node's host memory."""
        return self.host_node_bytes // self.ranks_per_node

    @property
    def host_bandwidth(self) -> float | None:
        """The host link the plan's cost model offloads over (None: the device's own, or none)."""
        return CPU_HOST_BANDWIDTH if self.offload and self.device == "cpu" else None

    @property
    def lora(self):
        """The adapters this step trains (lora.Lora), or None: every parameter trains."""
        if self.lora_r is None:
            return None
        from autosp.run.lora import Lora
        return Lora(self.lora_r, self.lora_alpha, self.lora_dropout, self.lora_targets)

    def with_length(self, seq_len: int) -> Step:
        return replace(self, seq_len=seq_len)

    # ------------------------------------------------------------ the step's budget
    @property
    def token_tensors(self) -> int:
        """int64 [batch, L] tensors a step takes: ids (the labels, too, when they are the ids), ids and labels (chat
        data's answers labelled), or ids, labels and position ids for packed documents."""
        return 3 if self.packing == "docs" else 2 if self.labels_apart else 1

    def token_bytes(self) -> int:
        """The token ids (and labels, positions) a rank holds through its step; DPO: the ids and labels of two
        sequences per pair and their fp32 reference log-probabilities (run/dpo.py)."""
        if self.objective == "dpo":
            from autosp.run.dpo import token_bytes
            return token_bytes(self.rank_batch, self.seq_len or 0)
        return 8 * self.token_tensors * self.rank_batch * (self.seq_len or 0)

    def activation_host_bytes(self, optimizer_host: int) -> int:
        """What this rank's plan may offload: its share of the node's host memory, less the optimizer's
        (0 without --offload)."""
        return max(0, self.host_share - optimizer_host) if self.offload else 0

    def step_budget(self, resident: int):
        """The remat budget the step is planned under: --memory-budget as given; else what --memory leaves the
        step after `resident` bytes (the model state and optimizer state kept across steps, the token ids);
        else None (autograd's saving)."""
        if self.memory_budget is not None:
            return self.memory_budget
        if self.memory is None:
            return None
        return max(1, self.memory_bytes - resident)

    # ------------------------------------------------------------ back to a command line
    def argv(self) -> list[str]:
        """The step's flags as `autosp train` takes them: every value written out, so the command runs this step
        wherever it is pasted."""
        out = ["--model", self.model, "--sp", str(self.sp)]
        if self.dp != 1:
            out += ["--dp", str(self.dp)]
        if self.ring is not None:
            out += ["--ring", str(self.ring)]
        if self.seq_len is not None:
            out += ["--seq-len", str(self.seq_len)]
        out += ["--batch", str(self.global_batch)]
        if self.grad_accum != 1:
            out += ["--grad-accum", str(self.grad_accum)]
        out += ["--precision", self.precision]
        if self.reduce_dtype != "fp32":
            out += ["--reduce-dtype", self.reduce_dtype]
        out += ["--device", self.device]
        if self.gpu is not None:
            out += ["--gpu", self.gpu]
        if self.memory is not None:
            out += ["--memory", self.memory]
        if self.memory_budget is not None:
            out += ["--memory-budget", str(self.memory_budget)]
        if self.offload:
            out += ["--offload"]
        if self.host_memory is not None:
            out += ["--host-memory", self.host_memory]
        if self.optimizer != "adamw":
            out += ["--optimizer", self.optimizer]
        if self.optimizer_offload:
            out += ["--optimizer-offload"]
        if not self.tile:
            out += ["--no-tile"]
        if not self.shard_params:
            out += ["--no-shard-params"]
        out += ["--packing", self.packing]     # always: text defaults to docs, and the plan was for this one
        if self.rope_theta is not None:
            out += ["--rope-theta", f"{self.rope_theta:g}"]
        if self.rope_scaling is not None:
            out += ["--rope-scaling", self.rope_scaling]
        if self.objective != "sft":
            out += ["--objective", self.objective, "--beta", f"{self.beta:g}"]
        if self.lora_r is not None:
            out += ["--lora-r", str(self.lora_r), "--lora-alpha", f"{self.lora_alpha:g}", "--lora-dropout",
                    f"{self.lora_dropout:g}"] + (["--lora-targets", ",".join(self.lora_targets)]
                                                if self.lora_targets else [])
        return out

    def train_command(self) -> str:
        import shlex
        return "autosp train " + " ".join(shlex.quote(x) for x in self.argv())


def parse_size(text: str, flag: str) -> int:
    from autosp.remat import parse_budget
    try:
        kind, value = parse_budget(text)
    except AutospError:
        kind = None
    if kind != "bytes":
        what = ("the memory per rank like 80GiB, 141GB or 24e9" if flag == "--memory" else
                "the host memory per node like 1TiB, 2TB or 1e12")
        raise AutospError(f"{flag} {text}: not a size. Fix: write {what}.")
    return int(value)


def parse_budget_flag(text):
    """--memory-budget: a fraction of the no-remat peak (0.5), bytes per rank ('6GiB', 6e9) or 'least'."""
    if text is None:
        return None
    from autosp.remat import parse_budget
    if isinstance(text, str) and text.strip().lower() == "least":
        return "least"
    try:
        value = float(text)
    except ValueError:
        parse_budget(text)                      # '6GiB'; raises with the fix for anything else
        return text
    if value <= 1.0:
        parse_budget(value)
        return value
    if value != int(value):
        raise AutospError(f"--memory-budget {text}: a fraction is at most 1 and bytes are whole. Fix: 0.5 (half "
                          "the no-remat peak) or a size such as 6GiB.")
    return int(value)


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _bf16_works(device: str) -> str | None:
    """None if this torch computes a bf16 step on `device` (a matmul, attention, a cast back); else why not."""
    import torch
    try:
        x = torch.randn(2, 2, 8, 16, device=device).to(torch.bfloat16)
        y = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True) @ x.transpose(-1, -2)
        y.float().sum().item()
    except Exception as exc:  # noqa: BLE001 - any failure means the precision cannot run here
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


BF16_CHECK = _bf16_works        # tests replace it to stand for a torch without bf16


def step_of(a, verb: str) -> Step:
    """The Step a parsed command line describes, defaults resolved and checked (AutospError with the fix)."""
    import torch
    if a.renamed_dtype is not None:
        raise AutospError(f"--dtype {a.renamed_dtype}: the flag was renamed. Fix: --precision fp32|bf16 for the "
                          "step's arithmetic" + (", --token-dtype uint16|uint32 for a .bin token file"
                                                 if verb == "train" else "") + ".")
    device = a.device
    gpu = getattr(a, "gpu", None)
    if gpu is not None and device == "cpu":
        raise AutospError(f"--gpu {gpu} --device cpu: a GPU's plan runs on the GPU. Fix: --device cuda, or leave "
                          "--gpu out.")
    memory = a.memory
    if gpu is not None:
        device = "cuda"
        if memory is None and verb in ("plan", "explain"):
            from autosp.remat.cost import GPUS
            memory = f"{GPUS[gpu].memory / 2**30:g}GiB"
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and verb == "train" and not torch.cuda.is_available():
        raise AutospError("--device cuda: no CUDA device is visible. Fix: --device cpu, or run on a GPU machine.")
    sp = a.sp
    if sp is None:
        if in_torchrun():
            sp = max(1, int(os.environ["WORLD_SIZE"]) // a.dp)
        elif device == "cuda" and torch.cuda.is_available():
            sp = max(1, torch.cuda.device_count() // a.dp)
        else:
            sp = 2
    precision = a.precision or ("bf16" if device == "cuda" else "fp32")
    step = Step(model=a.model, sp=sp, dp=a.dp, ring=a.ring, seq_len=a.seq_len, batch=a.batch, precision=precision,
                reduce_dtype=a.reduce_dtype, device=device, gpu=gpu, memory=memory,
                memory_budget=parse_budget_flag(a.memory_budget), offload=a.offload, host_memory=a.host_memory,
                optimizer=a.optimizer, optimizer_offload=a.optimizer_offload, tile=a.tile,
                shard_params=a.shard_params, packing=a.packing or "concat", rope_theta=a.rope_theta,
                rope_scaling=a.rope_scaling, grad_accum=a.grad_accum, objective=a.objective, beta=a.beta,
                **lora_of(a))
    check(step, verb)
    return step


def lora_of(a) -> dict:
    """The Step's --lora-* fields from a parsed command line (AutospError with the fix for a bad one)."""
    r = getattr(a, "lora_r", None)
    alpha, dropout, names = (getattr(a, k, None) for k in ("lora_alpha", "lora_dropout", "lora_targets"))
    if r is None:
        given = [f for f, v in (("--lora-alpha", alpha), ("--lora-dropout", dropout or None),
                                ("--lora-targets", names)) if v is not None]
        if given:
            raise AutospError(f"{' '.join(given)} without --lora-r: the adapters have no rank, so nothing would use "
                              "them. Fix: add --lora-r 16 (or leave them out to train every parameter).")
        return {}
    if not 0.0 <= (dropout or 0.0) < 1.0:
        raise AutospError(f"--lora-dropout {dropout}: a probability in [0, 1). Fix: --lora-dropout 0.05 (or 0).")
    targets = None if names is None else tuple(t.strip() for t in names.split(",") if t.strip())
    if targets is not None and not targets:
        raise AutospError(f"--lora-targets {names!r}: no module names. Fix: --lora-targets q_proj,v_proj (or leave it "
                          "out: every Linear projection).")
    return {"lora_r": r, "lora_alpha": float(alpha) if alpha is not None else 2.0 * r,
            "lora_dropout": float(dropout or 0.0), "lora_targets": targets}


def check(step: Step, verb: str) -> None:
    """Every check of a Step that needs no model: AutospError with the fix."""
    parts = step.dp * step.grad_accum
    if step.global_batch % parts:
        over = f"--dp {step.dp} ranks" + (f" x --grad-accum {step.grad_accum} micro-steps" if step.grad_accum > 1 else "")
        raise AutospError(f"--batch {step.global_batch} does not split over {over}. Fix: a multiple of {parts}, e.g. "
                          f"--batch {parts * max(1, step.global_batch // parts)}.")
    if step.seq_len is not None and step.seq_len < 2:
        raise AutospError(f"--seq-len {step.seq_len}: a causal LM needs at least 2 tokens. Fix: --seq-len 512.")
    if step.ring is not None and step.sp % step.ring:
        divisors = [r for r in range(1, step.sp + 1) if step.sp % r == 0]
        raise AutospError(f"--ring {step.ring} does not divide --sp {step.sp} (sp = U x R: an all-to-all over U "
                          f"ranks times a ring over R). Fix: --ring one of {divisors}, or leave --ring out.")
    if step.memory is not None:
        step.memory_bytes                               # a bad size fails here
    step.host_node_bytes
    if step.offload and step.host_share == 0:
        raise AutospError(f"--offload with --host-memory {step.host_memory}: no host memory is left for "
                          f"activations ({step.ranks_per_node} ranks share the node). Fix: --host-memory with the "
                          "node's size, or leave --offload out.")
    if step.rope_scaling is not None:
        from autosp.run.models import parse_rope_scaling
        parse_rope_scaling(step.rope_scaling)
    if step.optimizer == "sgd" and step.optimizer_offload:
        raise AutospError("--optimizer sgd --optimizer-offload: the offloaded optimizer is AdamW (ZeRO-Offload's). "
                          "Fix: --optimizer adamw, or leave --optimizer-offload out.")
    if step.precision != "fp32" and not step.sharded and not step.optimizer_offload:
        raise AutospError(f"--precision {step.precision} --no-shard-params: mixed precision keeps fp32 master weights "
                          "apart from the bf16 copy the step computes with, and autosp keeps them sharded (FSDP2's "
                          "layout) or on the host (--optimizer-offload). Fix: leave out --no-shard-params, add "
                          "--optimizer-offload, or --precision fp32.")
    if step.precision != "fp32" and verb == "train":
        why = BF16_CHECK(step.device)
        if why is not None:
            raise AutospError(f"--precision {step.precision}: this torch ({_torch_version()}) cannot compute in "
                              f"bfloat16 on {step.device} ({why}). Fix: --precision fp32, or a torch build with "
                              f"bfloat16 kernels for {step.device}.")


def _torch_version() -> str:
    import torch
    return torch.__version__
