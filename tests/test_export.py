"""Export's RoPE check (autosp/run/export.py): the exported config.json runs the positions the run trained with, and
a config that names no RoPE is compared as such, never as the defaults a reader would fill in. Configs only: no
run and no checkpoint (the exports of real runs are test_cli's and test_walkthrough's)."""
from __future__ import annotations

import json

import pytest

from autosp.errors import AutospError
from autosp.run.export import check_rope, load_run, rope_entry

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 1, "n_head": 4, "n_positions": 256,
        "bos_token_id": 0, "eos_token_id": 0}


def folder(path, config: dict, rope: tuple = (None, None)) -> str:
    """A folder holding `config` as transformers writes it, with `rope` (theta, "TYPE:FACTOR") set on it first."""
    from transformers import AutoConfig

    from autosp.run.models import set_rope
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if any(x is not None for x in rope):
        cfg = AutoConfig.from_pretrained(str(path))
        set_rope(cfg, *rope)
        cfg.save_pretrained(str(path))
    return str(path)


def test_a_config_without_rope_names_none_where_rope_of_would_guess(tmp_path):
    from transformers import AutoConfig

    from autosp.run.models import rope_of
    gpt2 = AutoConfig.from_pretrained(folder(tmp_path / "gpt2", GPT2))
    assert rope_of(gpt2) == {"rope_type": "default", "rope_theta": 10000.0}       # the guess the check must not use
    assert rope_entry(gpt2) is None
    yarn = AutoConfig.from_pretrained(folder(tmp_path / "yarn", LLAMA, (50000.0, "yarn:4")))
    assert rope_entry(yarn) == rope_of(yarn) and rope_entry(yarn)["rope_type"] == "yarn"


def test_export_holds_the_written_config_to_the_runs_rope(tmp_path):
    run = folder(tmp_path / "run", LLAMA, (50000.0, "yarn:4"))
    assert check_rope(run, folder(tmp_path / "same", LLAMA, (50000.0, "yarn:4")))["factor"] == 4.0
    # the scaling lost (transformers' defaults fill in), or no RoPE at all: each refused, saying what each side has
    for name, config, rope, said in [("default", LLAMA, (50000.0, None), "'rope_type': 'default'"),
                                     ("theta", LLAMA, (10000.0, "yarn:4"), "'rope_theta': 10000.0"),
                                     ("gpt2", GPT2, (None, None), "says no RoPE settings")]:
        refused = (r"the run trained with \{.*'rope_type': 'yarn'.*the exported config\.json says .*so the folder "
                   r"would run other positions\. Fix:")
        with pytest.raises(AutospError, match=refused) as err:
            check_rope(run, folder(tmp_path / name, config, rope))
        assert said in str(err.value), (name, str(err.value))
    # neither names RoPE: compared as absent on both sides, not as two equal guesses
    assert check_rope(folder(tmp_path / "gpt2-run", GPT2), str(tmp_path / "gpt2")) is None
    with pytest.raises(AutospError, match="the run trained with no RoPE settings"):
        check_rope(folder(tmp_path / "gpt2-run2", GPT2), run)


def test_rope_flags_on_a_model_without_rope_are_refused(tmp_path):
    """eval's --rope-theta / --rope-scaling on a run whose positions are not rotary: set_rope would write settings
    the model never reads, and the evaluation would pass for one at the longer length."""
    run = folder(tmp_path / "gpt2", GPT2)
    with pytest.raises(AutospError, match=r"its config\.json \(gpt2\) names no RoPE settings .*Fix: leave them out"):
        load_run(run, rope=(None, "yarn:4"))
