"""LoRA and PEFT's adapter format, both ways, on a tiny random Llama (grouped-query attention,
SwiGLU) built from a config (no downloads):

* ``convert export-hf --adapter-only`` of a LoRA fine-tune writes a PEFT adapter that
  ``peft.PeftModel.from_pretrained`` loads over the base's export; its logits are plugtron's
  within 1e-5 (fp32);
* an adapter written by ``peft`` itself (one ``lora_A`` per fused group, random ``lora_B``),
  imported with ``convert import-hf --peft-adapter``, gives peft's logits within 1e-5, and
  exports back to the same tensors;
* peft's adapter as peft makes it (each module its own lora_A, some of q/k/v and gate/up
  adapted) imports as canonical LoRA's per-projection adapters, to peft's logits, and back;
* what plugtron's LoRA cannot express is refused with exit 2 naming the setting."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from plugtron.api import load_model
from plugtron.cli.main import cli
from plugtron.core.checkpoint import CheckpointReader
from plugtron.core.config_flags import apply_values
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.options import config_from_dict
from plugtron.core.training.loop import pretrain
from safetensors.torch import load_file

from tests.core.checkpoint.hf_models import convert, logits_of, save_random, tokens

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, SEQ = 96, 16
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, initializer_range=0.2)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: PEFT modules that plugtron fuses into one linear, which shares one lora_A.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(the HF directory, its transformers model, its plugtron import)."""
    root = tmp_path_factory.mktemp("peft")
    hf_dir, ckpt = str(root / "hf"), str(root / "base")
    model = save_random(transformers.LlamaForCausalLM, transformers.LlamaConfig(**LLAMA), hf_dir)
    convert("import-hf", hf_dir, ckpt)
    return hf_dir, model, ckpt


def _peft_logits(hf_dir: str, adapter_dir: str, batch: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    adapted = peft.PeftModel.from_pretrained(model, adapter_dir)
    adapted.eval()
    with torch.no_grad():
        return adapted(batch).logits.float()


def test_hook_transform_peft_adapter(base, tmp_path):
    """An exported adapter loads in peft and gives plugtron's logits; ``plugtron generate``
    of the fine-tune, its base moved and given with --pretrained-checkpoint, generates what
    peft's model does (greedy)."""
    hf_dir, _, imported = base
    ckpt, moved = str(tmp_path / "base"), str(tmp_path / "moved")
    shutil.copytree(imported, ckpt)
    config = config_from_dict(CheckpointReader(ckpt).config)
    apply_values(config, {
        "data": "mock", "seq_length": SEQ, "micro_batch_size": 2, "global_batch_size": 2,
        "train_iters": 2, "lr": 0.05, "progress": False, "attention_dropout": 0.0,
        "pretrained_checkpoint": ckpt, "finetune": True, "save": str(tmp_path / "ft"),
        "lora_rank": 4, "lora_alpha": 8.0}, "test")
    config.model.padded_vocab_size = None
    pretrain(config, world=single_process())
    convert("export-hf", str(tmp_path / "ft"), str(tmp_path / "adapter"), "--adapter-only")

    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    q, k = (f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_A.weight" for p in "qk")
    assert torch.equal(written[q], written[k]) and len(written) == 2 * 2 * len(TARGETS)
    assert max(t.abs().max() for n, t in written.items() if "lora_B" in n) > 0  # trained
    batch = tokens(VOCAB, (2, SEQ))
    with torch.no_grad():
        ours = load_model(str(tmp_path / "ft"))(batch)[..., :VOCAB].float()
    theirs = _peft_logits(hf_dir, str(tmp_path / "adapter"), batch)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)

    os.rename(ckpt, moved)
    ask = ["generate", "--load", str(tmp_path / "ft"), "--prompt-ids", "5 17 33 2",
           "--max-new-tokens", "6", "--greedy", "--json", "--device", "cpu"]
    refused = CliRunner().invoke(cli, ask)
    assert refused.exit_code == 2 and "--pretrained-checkpoint" in refused.output
    result = CliRunner().invoke(cli, [*ask, "--pretrained-checkpoint", moved])
    assert result.exit_code == 0, result.output
    generated = json.loads(result.output.strip().splitlines()[-1])["tokens"]
    model = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(hf_dir),
                                           str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        expected = model.generate(input_ids=torch.tensor([[5, 17, 33, 2]]), max_new_tokens=6,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generated == expected[0, 4:].tolist()


@pytest.fixture(scope="module")
def peft_adapter(base, tmp_path_factory):
    """An adapter written by peft on the base: random B, each fused group's A made one."""
    hf_dir, model, _ = base
    directory = str(tmp_path_factory.mktemp("peft") / "adapter")
    torch.manual_seed(1)
    adapted = peft.get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(hf_dir),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for layer in adapted.base_model.model.model.layers:
            for owner, group in ((layer.self_attn, FUSED[0]), (layer.mlp, FUSED[1])):
                shared = getattr(owner, group[0]).lora_A["default"].weight
                for name in group[1:]:
                    getattr(owner, name).lora_A["default"].weight.copy_(shared)
            for module in (*(getattr(layer.self_attn, p) for p in TARGETS[:4]),
                           *(getattr(layer.mlp, p) for p in TARGETS[4:])):
                module.lora_B["default"].weight.normal_(0, 0.2)
    adapted.save_pretrained(directory)
    return directory


def test_hook_transform_from_peft_adapter(base, peft_adapter, tmp_path):
    """An adapter written by peft imports to peft's logits, and exports back the same."""
    hf_dir, _, _ = base
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    result = convert("import-hf", hf_dir, ckpt, "--peft-adapter", peft_adapter)
    assert ("--lora-rank 4 --lora-alpha 8.0 --lora-dropout 0.0 --lora-target-modules "
            "linear_fc1,linear_fc2,linear_proj,linear_qkv") in result.output
    batch = tokens(VOCAB, (2, SEQ))
    theirs = _peft_logits(hf_dir, peft_adapter, batch)
    ours = logits_of(ckpt, batch, VOCAB)
    assert (theirs - transformers.LlamaForCausalLM.from_pretrained(hf_dir)(batch).logits
            ).abs().max() > 1e-2  # the adapter changes the output
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)

    convert("export-hf", ckpt, back, "--adapter-only")
    original, again = load_file(f"{peft_adapter}/adapter_model.safetensors"), \
        load_file(f"{back}/adapter_model.safetensors")
    assert set(original) == set(again)
    assert all(torch.equal(original[n], again[n]) for n in original)
    convert("export-hf", ckpt, str(tmp_path / "bf16"), "--adapter-only", "--dtype", "bfloat16")
    cast = load_file(str(tmp_path / "bf16" / "adapter_model.safetensors"))
    assert {t.dtype for t in cast.values()} == {torch.bfloat16}


def _edited(source: str, directory, config=None, drop=()) -> str:
    """A copy of adapter ``source`` with ``config`` merged into adapter_config.json and the
    tensors whose key contains one of ``drop`` left out."""
    from safetensors.torch import save_file
    directory.mkdir()
    with open(f"{source}/adapter_config.json") as f:
        adapter_config = {**json.load(f), **(config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config))
    tensors = {k: v for k, v in load_file(f"{source}/adapter_model.safetensors").items()
               if not any(d in k for d in drop)}
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return str(directory)


@pytest.mark.parametrize("config,drop,message", [
    ({"use_dora": True}, (), "use_dora True"),
    ({"use_rslora": True}, (), "use_rslora True"),
    ({"modules_to_save": ["lm_head"]}, (), "modules_to_save"),
    ({"rank_pattern": {"q_proj": 8}}, (), "rank_pattern"),
    ({"bias": "all"}, (), "bias 'all'"),
    ({}, ("layers.0.self_attn.k_proj",), "no adapter for model.layers.0.self_attn.k_proj"),
    ({}, ("layers.1.mlp.down_proj",), "no adapter for model.layers.1.mlp.down_proj"),
    ({"peft_type": "IA3"}, (), "peft_type 'IA3' is read by no installed model transform"),
])
def test_what_plugtrons_lora_cannot_express_is_refused_naming_it(
        base, peft_adapter, tmp_path, config, drop, message):
    edited = _edited(peft_adapter, tmp_path / "edited", config, drop)
    result = convert("import-hf", base[0], str(tmp_path / "out"), "--peft-adapter", edited,
                     exit_code=2)
    assert message in result.output


def test_per_module_adapters_import_as_canonical_lora_and_export_back(base, tmp_path):
    """peft's own adapter as it makes it (each module its own A) on some of the fused
    modules: canonical LoRA's per-projection adapters, peft's logits within 1e-5, and back."""
    hf_dir, _, _ = base
    adapter, ckpt, back = (str(tmp_path / n) for n in ("adapter", "ckpt", "back"))
    torch.manual_seed(2)
    adapted = peft.get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(hf_dir),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj",
                                                           "down_proj"]))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    adapted.save_pretrained(adapter)
    result = convert("import-hf", hf_dir, ckpt, "--peft-adapter", adapter)
    assert "--lora-target-modules linear_fc1_up,linear_fc2,linear_q,linear_v" in result.output
    batch = tokens(VOCAB, (2, SEQ))
    torch.testing.assert_close(logits_of(ckpt, batch, VOCAB),
                               _peft_logits(hf_dir, adapter, batch), rtol=0, atol=1e-5)
    convert("export-hf", ckpt, back, "--adapter-only")
    original = load_file(f"{adapter}/adapter_model.safetensors")
    again = load_file(f"{back}/adapter_model.safetensors")
    assert set(original) == set(again)
    assert all(torch.equal(original[n], again[n]) for n in original)


def test_adapter_only_needs_a_run_with_a_transform_that_writes_one(base, tmp_path):
    result = convert("export-hf", base[2], str(tmp_path / "out"), "--adapter-only",
                     exit_code=2)
    assert "this checkpoint's run applied none" in result.output
