"""Greedy generation equals transformers' ``generate(do_sample=False)`` token for token, on the
model that ``plugtron convert export-hf`` writes (tiny random Llama-layout with GQA and
GPT-2-layout models, made here), for a batch of equal prompts and a left-padded batch."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from plugtron.api import generate, load_model
from plugtron.cli.main import cli

from gpt_plugin.tests.test_hf_convert import make_hf

transformers = pytest.importorskip("transformers")

NEW = 10
PROMPTS = [[11, 42, 7, 93, 3, 58], [2, 71, 19], [60, 5, 33, 8, 24]]


def _hf_greedy(model, prompts):
    """transformers' greedy generate over a left-padded batch (its attention mask)."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                         pad_token_id=0)
    return out[:, longest:].tolist()


@pytest.mark.parametrize("kind", ["llama-gqa", "gpt2"])
def test_greedy_equals_transformers_generate_on_the_exported_model(kind, tmp_path):
    hf_dir, ckpt, exported = (str(tmp_path / n) for n in ("hf", "ckpt", "exported"))
    make_hf(kind, hf_dir)
    runner = CliRunner()
    for args in (["import-hf", hf_dir, ckpt], ["export-hf", ckpt, exported]):
        result = runner.invoke(cli, ["convert", *args])
        assert result.exit_code == 0, result.output
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    hf.generation_config.eos_token_id = None  # run every row to NEW tokens, as ours below
    model = load_model(ckpt)
    equal = [PROMPTS[0], PROMPTS[0][::-1]]
    assert generate(model, equal, NEW, greedy=True).tokens == _hf_greedy(hf, equal)
    ours = generate(model, PROMPTS, NEW, greedy=True).tokens
    assert ours == _hf_greedy(hf, PROMPTS)
    assert len({tuple(t) for t in ours}) > 1  # not one token repeated everywhere
    if kind == "gpt2":  # 32 learned positions: 6 + 30 do not fit
        with pytest.raises(ValueError, match="32 learned positions"):
            generate(model, PROMPTS, 30)


def test_hybrid_greedy_equals_transformers_nemotron_h(tmp_path):
    """Mamba + attention (NemotronH ``M*-M-*``): our Mamba cache (conv window, SSM state)
    against transformers' own cache, on the exported model; equal-length prompts."""
    from gpt_plugin.tests.test_hybrid_hf_convert import make_hf as make_hybrid

    hf_dir, ckpt, exported = (str(tmp_path / n) for n in ("hf", "ckpt", "exported"))
    make_hybrid("nemotron_h", hf_dir)
    runner = CliRunner()
    for args in (["import-hf", "--model", "hybrid", hf_dir, ckpt], ["export-hf", ckpt, exported]):
        result = runner.invoke(cli, ["convert", *args])
        assert result.exit_code == 0, result.output
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    hf.generation_config.eos_token_id = None
    prompts = [PROMPTS[0], PROMPTS[0][::-1]]
    ours = generate(load_model(ckpt), prompts, NEW, greedy=True).tokens
    assert ours == _hf_greedy(hf, prompts)
