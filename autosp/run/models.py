"""Models by name: built-in Llama-style presets, or a Hugging Face config (file or folder).

    cfg = model_config("tiny")                  # or "llama-3.1-8b", or "path/to/config.json", or a folder
    model = build_model(cfg, seed=0)            # random init, the same on every rank for the same seed
    model = build_model(cfg, seed=0, weights="path/to/folder")   # the folder's safetensors

Presets are shapes: `tiny` and `small` train on CPU; the Llama 3 shapes are for `autosp plan`
(training them randomly initialised works too, on hardware that holds them). No network is used.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from autosp.errors import AutospError


@dataclass(frozen=True)
class Preset:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie: bool = False
    rope_theta: float = 10000.0
    max_positions: int = 131072
    about: str = ""


# Byte-level presets (vocab 256) train on the default corpus; the Llama 3 shapes are the published
# configurations' sizes (RoPE scaling left out: it changes no shape and no byte of memory).
PRESETS = {
    "tiny": Preset(128, 384, 4, 4, 2, 256, about="0.8M parameters, byte-level; seconds per step on 2 CPU cores"),
    "small": Preset(512, 1536, 8, 8, 4, 256, about="25M parameters, byte-level"),
    "llama-3.2-1b": Preset(2048, 8192, 16, 32, 8, 128256, tie=True, rope_theta=500000.0, about="Llama 3.2 1B shape"),
    "llama-3.2-3b": Preset(3072, 8192, 28, 24, 8, 128256, tie=True, rope_theta=500000.0, about="Llama 3.2 3B shape"),
    "llama-3.1-8b": Preset(4096, 14336, 32, 32, 8, 128256, rope_theta=500000.0, about="Llama 3.1 8B shape"),
}


@dataclass(frozen=True)
class ModelSpec:
    name: str              # what the user passed
    config: object         # a transformers PretrainedConfig
    weights: str | None    # a folder with safetensors, or None (random init)

    @property
    def vocab(self) -> int:
        return int(self.config.vocab_size)


def _hf_config(p: Preset):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=p.vocab, hidden_size=p.hidden, intermediate_size=p.intermediate,
                       num_hidden_layers=p.layers, num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
                       max_position_embeddings=p.max_positions, tie_word_embeddings=p.tie,
                       rope_theta=p.rope_theta, attn_implementation="sdpa")


def model_config(name: str, *, layers: int | None = None, rope_theta: float | None = None,
                 rope_scaling: str | None = None) -> ModelSpec:
    """The config for a preset name or a path; `layers` overrides the depth (planning probes); `rope_theta` and
    `rope_scaling` ("yarn:4") extend its context (set_rope)."""
    if name in PRESETS:
        cfg = _hf_config(PRESETS[name])
        weights = None
    else:
        cfg, weights = _config_from_path(name)
    if layers is not None:
        cfg = cfg.__class__(**{**cfg.to_dict(), "num_hidden_layers": layers})
    if rope_theta is not None or rope_scaling is not None:
        set_rope(cfg, rope_theta, rope_scaling)
    cfg._attn_implementation = "sdpa"
    return ModelSpec(name, cfg, weights)


def spec_of(step) -> ModelSpec:
    """The model of a Step (run/config.py), its RoPE settings applied."""
    return model_config(step.model, rope_theta=step.rope_theta, rope_scaling=step.rope_scaling)


ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")


def parse_rope_scaling(text: str) -> tuple[str, float]:
    """'yarn:4' -> ('yarn', 4.0); AutospError with the fix otherwise."""
    kind, _, factor = text.partition(":")
    try:
        value = float(factor)
    except ValueError:
        value = 0.0
    if kind not in ROPE_TYPES or not value > 1.0:
        raise AutospError(f"--rope-scaling {text}: expected TYPE:FACTOR with TYPE one of {', '.join(ROPE_TYPES)} and a "
                          "factor above 1. Fix: --rope-scaling yarn:4 (4 times the model's positions).")
    return kind, value


def rope_of(cfg) -> dict:
    """The config's RoPE settings as transformers' rope_parameters (5.x) or rope_theta + rope_scaling (4.x) say."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict):
        return dict(params)
    out = {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(scaling, dict):
        out.update(scaling)
        out["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return out


def set_rope(cfg, theta: float | None, scaling: str | None) -> None:
    """Extend a config's context: RoPE's base `theta`; `scaling` 'TYPE:FACTOR' multiplies max_position_embeddings by
    FACTOR and scales RoPE as transformers' rope_scaling of that type does (the original length kept for yarn and
    llama3). On the config (transformers 5: rope_parameters; 4: rope_theta, rope_scaling), so that the model
    built from it, the checkpoints' config.json and an export carry it."""
    rope = rope_of(cfg)
    if theta is not None:
        rope["rope_theta"] = float(theta)
    if scaling is not None:
        kind, factor = parse_rope_scaling(scaling)
        original = int(cfg.max_position_embeddings)
        rope.update(rope_type=kind, factor=factor)
        if kind in ("yarn", "llama3", "dynamic"):
            rope["original_max_position_embeddings"] = original
        if kind == "llama3":
            rope.setdefault("low_freq_factor", 1.0)
            rope.setdefault("high_freq_factor", 4.0)
        cfg.max_position_embeddings = int(original * factor)
    if hasattr(cfg, "rope_parameters"):
        cfg.rope_parameters = rope
    else:
        cfg.rope_theta = rope.pop("rope_theta")
        cfg.rope_scaling = None if rope.get("rope_type") == "default" else {**rope, "type": rope["rope_type"]}


def _config_file(path: str) -> str:
    """The config.json a --model path names, or an AutospError that says what to pass."""
    choices = ", ".join(PRESETS)
    if not os.path.exists(path):
        raise AutospError(f"--model {path}: no such preset or path. Fix: pass one of the presets ({choices}), "
                          "a Hugging Face config.json, or a folder that holds one.")
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise AutospError(f"--model {path}: the folder has no config.json. Fix: point --model at a Hugging Face "
                          f"model folder (config.json, optionally *.safetensors) or at a config.json file.")
    return file


def peek_vocab(name: str) -> int:
    """The vocabulary size of a preset or config path, read without importing transformers (the
    launcher checks the data against it before starting any rank)."""
    if name in PRESETS:
        return PRESETS[name].vocab
    file = _config_file(name)
    try:
        with open(file) as f:
            raw = json.load(f)
        return int(raw["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AutospError(f"--model {name}: {file} is not a model config with a vocab_size ({type(exc).__name__}: "
                          f"{exc}). Fix: pass a Hugging Face config.json (model_type, vocab_size, ...).") from None


def peek_positions(name: str) -> int | None:
    """The positions (max_position_embeddings) of a preset or config path, read without importing transformers where
    the file says them; None where only transformers' defaults would (the launcher's warning then builds the config)."""
    if name in PRESETS:
        return PRESETS[name].max_positions
    try:
        with open(_config_file(name)) as f:
            value = json.load(f).get("max_position_embeddings")
        return int(value) if value is not None else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _config_from_path(path: str):
    file = _config_file(path)
    folder = os.path.dirname(file) or "."
    from transformers import AutoConfig
    try:
        cfg = AutoConfig.from_pretrained(folder if os.path.isdir(path) else file, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
        raise AutospError(f"--model {path}: transformers cannot read {file} as a model config ({exc}). "
                          "Fix: pass a Hugging Face config.json with a 'model_type'.") from None
    weights = folder if os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(folder)) else None
    return cfg, weights


def with_attention(make, *args, **kwargs):
    """make(..., attn_implementation="sdpa"), which autosp shards as Ulysses attention; a model whose class has
    no SDPA path (Mamba, Mamba-2: no attention; gpt-oss: sinks) is built with its eager code instead."""
    try:
        return make(*args, attn_implementation="sdpa", **kwargs)
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
        return make(*args, attn_implementation="eager", **kwargs)


def build_model(spec: ModelSpec, *, seed: int = 0, device: str = "cpu", dtype=None):
    """A causal LM for the spec: the folder's weights if it has them, else random init seeded by `seed`
    (the same parameters on every rank). On the meta device nothing is allocated."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()            # "Loading weights" once per rank: not the run's progress
    torch.manual_seed(seed)
    try:
        if spec.weights is not None and device != "meta":
            model = with_attention(AutoModelForCausalLM.from_pretrained, spec.weights, local_files_only=True,
                                   dtype=dtype)
        else:
            with torch.device(device):
                model = with_attention(AutoModelForCausalLM.from_config, spec.config)
    except ValueError as exc:
        raise AutospError(f"--model {spec.name}: transformers cannot build a causal LM from it ({exc}). "
                          "Fix: pass a config of a causal language model (e.g. model_type 'llama').") from None
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device) if device != "meta" else model


def count_parameters(model) -> int:
    """Distinct parameters (tied weights once)."""
    return sum(p.numel() for p in model.parameters())


def describe(spec: ModelSpec) -> str:
    c = spec.config
    kind = PRESETS[spec.name].about if spec.name in PRESETS else f"{c.model_type} from {spec.name}"
    heads = getattr(c, "num_attention_heads", None)
    heads = (f"{heads}/{getattr(c, 'num_key_value_heads', None) or heads} heads" if heads
             else f"{getattr(c, 'num_heads', '?')} SSM heads, no attention")
    return (f"{spec.name} ({kind}; {c.num_hidden_layers} layers, hidden {c.hidden_size}, {heads}, "
            f"vocab {c.vocab_size}" + (", weights from the folder" if spec.weights else ", random init") + ")")
