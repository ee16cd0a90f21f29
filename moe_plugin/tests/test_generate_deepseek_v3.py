"""Generation from an imported Hugging Face ``deepseek_v3`` model (tiny, random, built from a
config: MLA, a dense layer then MoE layers with sigmoid group-limited routing and expert bias):
greedy tokens equal transformers' ``generate(do_sample=False)`` token for token, over a
left-padded batch, with query compression on and off (and YaRN with an MTP layer, which
generation does not run); the KV cache holds MLA's compressed latent and rotated shared key, not
the expanded keys and values; cached generation equals generation without a cache."""

from __future__ import annotations

import pytest
import torch
from plugtron.api import InferenceState, forward_context, generate, load_model

from moe_plugin.tests.test_hf_deepseek_v3 import BASE, YARN, make_hf  # skips without transformers
from tests.core.checkpoint.hf_models import convert

transformers = pytest.importorskip("transformers")

NEW = 10
PROMPTS = [[11, 42, 7, 93, 3, 58], [2, 71, 19], [60, 5, 33, 8, 24]]  # left padding
CASES = {
    "q-lora": ({}, 0),
    "no-q-lora": ({"q_lora_rank": None}, 0),
    "yarn-mtp": ({"rope_parameters": YARN, "num_nextn_predict_layers": 1}, 1),
}


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


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers_and_the_cache_holds_the_latent(case, tmp_path):
    changes, depth = CASES[case]
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    hf, _ = make_hf(changes, depth, hf_dir)
    hf.generation_config.eos_token_id = None  # every row runs to NEW tokens, as ours
    convert("import-hf", hf_dir, ckpt)
    model = load_model(ckpt)

    ours = generate(model, PROMPTS, NEW, greedy=True).tokens
    assert ours == _hf_greedy(hf, PROMPTS)
    assert len({tuple(t) for t in ours}) == len(PROMPTS)  # not one token everywhere
    assert generate(model, PROMPTS, NEW, greedy=True, use_cache=False).tokens == ours

    # One prompt step by hand: per layer, the normed latent and the rotated shared key.
    rank, pos = BASE["kv_lora_rank"], BASE["qk_rope_head_dim"]
    state = InferenceState(torch.ones(2, 9, dtype=torch.bool))
    with forward_context(inference=state), torch.no_grad():
        model.module(torch.tensor([PROMPTS[0], PROMPTS[0][::-1]]))
    layers = BASE["num_hidden_layers"]
    for i in range(layers):
        latent, k_rope = state.cached(f"decoder.layers.{i}.self_attention")
        assert latent.shape == (2, 9, rank) and k_rope.shape == (2, 9, 1, pos)
    assert state.bytes_per_token() == layers * (rank + pos) * 4  # fp32, nothing else cached
