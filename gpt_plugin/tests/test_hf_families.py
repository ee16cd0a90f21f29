"""The architectures people download, imported and exported: GPT-2 as published (gelu_new),
Llama 3.x, linear and YaRN rope scaling, Mistral's sliding window (sequences longer than the
window), Qwen2's q/k/v biases and Qwen3's per-head q/k norms, as tiny random models built from configs
(no downloads). plugtron's logits equal transformers' CPU forward within 1e-5 (fp32); export
after import gives back the same tensors bit for bit and a config transformers reads as the
same model; rope types plugtron does not compute are refused naming the type (exit 2)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.options import config_from_dict
from plugtron.core.training.loop import setup

from tests.core.checkpoint.hf_models import (
    assert_exports_back,
    assert_same_checkpoint_tensors,
    convert,
    logits_of,
    save_random,
    tokens,
)

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 16
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, initializer_range=0.2)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
#: Qwen's long-context YaRN (its original context shrunk so that the ramp falls inside the
#: head's channels), and one with every option away from its default.
QWEN_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 16}
ODD_YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 8.0,
            "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2,
            "mscale": 0.707, "mscale_all_dim": 0.5, "truncate": False}

#: kind -> (config class, model class, config arguments, a flag the import must print)
CASES = {
    "gpt2-gelu_new": ("GPT2Config", "GPT2LMHeadModel",
                      dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                           activation_function="gelu_new", initializer_range=0.2),
                      "--openai-gelu"),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(LLAMA, rope_parameters=LLAMA3),
                    "--use-rope-scaling"),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM",
                          dict(LLAMA, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 5000.0}),
                          "--rotary-seq-len-interpolation-factor 2.0"),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(LLAMA, sliding_window=5),
                       "--window-size 4,0"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(LLAMA, tie_word_embeddings=True),
              "--add-qkv-bias"),
    "qwen3-window": ("Qwen3Config", "Qwen3ForCausalLM",
                     dict(LLAMA, head_dim=16, use_sliding_window=True, sliding_window=6,
                          max_window_layers=0), "--qk-layernorm"),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(LLAMA, rope_parameters=QWEN_YARN),
                   "--rope-type yarn --rotary-scaling-factor 4.0"),
    "qwen3-yarn-options": ("Qwen3Config", "Qwen3ForCausalLM",
                           dict(LLAMA, head_dim=16, rope_parameters=ODD_YARN),
                           "--mscale 0.707 --mscale-all-dim 0.5"),
}


def make_hf(kind: str, directory: str):
    config_cls, model_cls, arguments, _ = CASES[kind]
    return save_random(getattr(transformers, model_cls),
                       getattr(transformers, config_cls)(**arguments), directory)


@pytest.mark.parametrize("kind", list(CASES))
def test_import_gives_transformers_logits_and_exports_back(kind, tmp_path):
    hf_dir, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    model = make_hf(kind, hf_dir)
    result = convert("import-hf", hf_dir, ckpt)
    assert CASES[kind][3] in result.output

    batch = tokens(VOCAB, (2, SEQ))
    ours = logits_of(ckpt, batch, VOCAB)
    with torch.no_grad():
        theirs = model(batch).logits.float()
    assert theirs.std() > 0.1
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()

    reloaded = assert_exports_back(model, ckpt, back)
    reloaded.eval()
    with torch.no_grad():  # the exported config.json describes the same function
        assert torch.equal(reloaded(batch).logits, model(batch).logits)


def test_window_shorter_than_sequence_changes_the_output(tmp_path):
    """The Mistral case is not vacuous: without the window the logits differ."""
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    model = make_hf("mistral-window", hf_dir)
    model.config.sliding_window = None
    batch = tokens(VOCAB, (2, SEQ))
    convert("import-hf", hf_dir, ckpt)
    with torch.no_grad():
        full = model(batch).logits.float()
    assert (logits_of(ckpt, batch, VOCAB) - full).abs().max() > 1e-3


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "factor": 2.0,
                                   "original_max_position_embeddings": 32}])
def test_unsupported_rope_types_are_refused_by_name(rope, tmp_path):
    hf_dir = tmp_path / "hf"
    make_hf("llama3-rope", str(hf_dir))
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    (hf_dir / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(cli, ["convert", "import-hf", str(hf_dir),
                                      str(tmp_path / "ckpt")])
    assert result.exit_code == 2, result.output
    assert repr(rope["rope_type"]) in result.output
    assert "Traceback" not in result.output
    assert not os.path.exists(tmp_path / "ckpt")


@pytest.mark.parametrize("flags,model_type", [
    ({"qk-layernorm": True, "window-size": "5,0"}, "qwen3"),
    ({"add-qkv-bias": True, "use-rope-scaling": True,
      "rope-scaling-original-max-position-embeddings": 8}, "qwen2"),
    ({"window-size": "3", "rotary-seq-len-interpolation-factor": 2.0}, "mistral"),
    # mscale without mscale_all_dim: transformers would ignore it; config.json states the
    # attention factor plugtron computes
    ({"rope-type": "yarn", "rotary-scaling-factor": 4.0, "mscale": 0.8,
      "yarn-original-max-position-embeddings": 16}, "llama"),
])
def test_plugtron_model_exports_to_its_family_and_back_unchanged(flags, model_type, tmp_path):
    """A model made by plugtron (not imported) exports as the family its flags select, and
    importing that gives back every tensor and the same architecture."""
    from plugtron.core.checkpoint import checkpointer
    from plugtron.testing import make_config

    saved, hf_dir, again = (str(tmp_path / n) for n in ("save", "hf", "again"))
    llama = {"normalization": "RMSNorm", "swiglu": True, "position-embedding-type": "rope",
             "num-query-groups": 2, "add-bias-linear": False, "num-layers": 2,
             "untie-embeddings-and-output-weights": True, "save": saved}
    run = setup(make_config({**llama, **flags}), world=single_process())
    checkpointer(run).save(0)
    convert("export-hf", saved, hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        assert json.load(f)["model_type"] == model_type
    convert("import-hf", hf_dir, again)
    before, after = assert_same_checkpoint_tensors(saved, again, 128)
    from plugtron_gpt.gpt.sizes import architecture

    assert (architecture(config_from_dict(after.config))
            == architecture(config_from_dict(before.config)))
