"""LoRA in one process: an adapted linear adds ``alpha / r * B A x`` (by hand, column- and
row-parallel, a fused [gate; up] included); at step 0 the adapted model is the base model
bitwise; training moves the adapters only (the base bitwise unchanged, without gradient
buffers or optimizer state); the refusals before launch (exit 2)."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F
from plugtron.api import ConfigError, load_model
from plugtron.core.interchange.hf_export import export_hf
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.distributed import single_process
from plugtron.core.tools.estimate import estimate_memory
from plugtron.core.training.builder import build_model
from plugtron.core.training.loop import pretrain, setup, train
from plugtron.core.training.optimizer import named_params
from plugtron.core.training.validate import validate
from plugtron.testing.checkpoints import read_checkpoint
from safetensors.torch import load_file

from tests.utils import tiny_config

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "swiglu": True}


def _chunk(**flags) -> torch.nn.Module:
    config = tiny_config(**flags)
    validate(config, 1)
    (chunk,) = build_model(config, ParallelContext.build(1, 0, device=torch.device("cpu")))
    return chunk


def test_an_adapted_linear_adds_the_scaled_low_rank_update():
    chunk = _chunk(**LORA)
    modules = dict(chunk.named_modules())
    torch.manual_seed(0)
    for name in ("decoder.layers.0.self_attention.linear_qkv",  # column-parallel
                 "decoder.layers.1.mlp.linear_fc1",  # column-parallel, fused [gate; up]
                 "decoder.layers.1.mlp.linear_fc2"):  # row-parallel
        linear = modules[name]
        a, b = linear.adapter.linear_in.weight, linear.adapter.linear_out.weight
        with torch.no_grad():
            b.normal_()  # B starts at zero: give it values to see
        x = torch.randn(2, 5, linear.weight.shape[1])
        out, _ = linear(x)
        by_hand = F.linear(x, linear.weight, linear.bias) + 8.0 / 4 * (x @ a.t() @ b.t())
        torch.testing.assert_close(out, by_hand, rtol=1e-6, atol=1e-6)
        assert a.shape == (4, linear.weight.shape[1]) and b.shape == (linear.weight.shape[0], 4)


def test_at_step_zero_the_adapted_model_is_the_base_model():
    base, adapted = _chunk(swiglu=True), _chunk(**LORA)
    tokens = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        assert torch.equal(adapted(tokens), base(tokens))
    names = {n for n, _ in adapted.named_parameters()}
    assert {n for n, _ in base.named_parameters()} < names
    assert "decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight" in names


def test_training_moves_the_adapters_only():
    config = tiny_config(train_iters=3, **LORA)
    run = setup(config, world=single_process())
    (chunk,) = run.model_chunks
    before = {n: p.detach().clone() for n, p in chunk.module.named_parameters()}
    train(run, MetricsLogger(config, rank=1))
    trained = {n for n, _ in named_params(run.model_chunks)}
    assert trained and all(".adapter." in n for n in trained)
    buffered = {id(p) for buffer in chunk.grad_buffers for p in buffer.params}
    for name, param in chunk.module.named_parameters():
        if name in trained:
            assert id(param) in buffered
            if name.endswith("linear_out.weight"):
                assert not torch.equal(param, before[name]), f"{name} did not train"
        else:
            assert torch.equal(param, before[name]), f"frozen {name} changed"
            assert id(param) not in buffered
    assert set(run.optimizer.sharded_state_dict()) - {"__optimizer__"} <= trained


@pytest.mark.parametrize("flags,message", [
    ({"lora_alpha": 16.0}, "--lora-alpha without --lora-rank: LoRA is off"),
    ({"model_transforms": ["lora"]}, "--lora-rank must be a positive rank"),
    ({"lora_rank": 4, "lora_dropout": 1.0}, r"--lora-dropout must be in \[0, 1\)"),
    ({"lora_rank": 3, "tp": 2}, "--lora-rank 3 does not split over tp 2"),
])
def test_bad_settings_are_refused_before_launch(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**flags), 2 if flags.get("tp") else 1)


def test_a_target_the_model_lacks_is_refused_naming_its_linears():
    config = tiny_config(lora_rank=4, lora_target_modules=["linear_qkv,linear_nope"])
    with pytest.raises(ConfigError, match="--lora-target-modules linear_nope: the model has no "
                                          "such linear; its linears are linear_fc1, linear_fc2"):
        estimate_memory(config, 1)


#: A Llama-shaped tiny model, which Hugging Face export maps.
LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
         "add_bias_linear": False, "untie_embeddings_and_output_weights": True}


def test_hook_transform_merged_tensors(tmp_path, monkeypatch):
    """export-hf folds the adapters into their linears (W + alpha/r B A): the exported plain
    model computes what the LoRA model did (fp32, 1e-5)."""
    monkeypatch.setenv("PLUGTRON_HF_CACHE", str(tmp_path / "cache"))
    ckpt, hf_dir = str(tmp_path / "ck"), str(tmp_path / "hf")
    pretrain(tiny_config(train_iters=3, save=ckpt, lora_rank=4, lora_alpha=8.0, **LLAMA),
             world=single_process())
    b = read_checkpoint(ckpt)["tensors"][
        "model/decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight"]
    assert b.abs().max() > 0  # trained: the merge has something to add
    export_hf(ckpt, hf_dir)
    exported = [key for file in pathlib.Path(hf_dir).glob("*.safetensors")
                for key in load_file(str(file))]
    assert exported and not [key for key in exported if "adapter" in key or "lora" in key]
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(load_model(hf_dir)(tokens), load_model(ckpt)(tokens),
                               rtol=1e-5, atol=1e-5)


def test_experts_are_refused_and_a_moe_model_takes_adapters_on_attention():
    with pytest.raises(ConfigError, match=r"experts\.local_experts\.0\.linear_fc1 is an "
                                          r"expert's linear; LoRA on experts is not supported"):
        _chunk(num_experts=2, lora_rank=4)
    chunk = _chunk(num_experts=2, lora_rank=4, lora_target_modules=["linear_qkv,linear_proj"])
    adapted = {n.split(".adapter.")[0].rsplit(".", 1)[1] for n, _ in chunk.named_parameters()
               if ".adapter." in n}
    assert adapted == {"linear_qkv", "linear_proj"}
