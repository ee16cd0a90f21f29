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


@pytest.mark.parametrize("layout", [{"pp": 2}, {"pp": 2, "vp": 2, "num_layers": 4}])
def test_a_target_the_model_lacks_is_refused_under_a_pipeline_too(layout):
    """Each stage holds some layers only: the targets are checked against the whole model
    before launch (a stage's chunk alone cannot tell), so a name no layer has is refused."""
    config = tiny_config(lora_rank=4, lora_target_modules=["linear_nope"], **layout)
    with pytest.raises(ConfigError, match="--lora-target-modules linear_nope: the model has no "
                                          "such linear"):
        validate(config, 2)
    validate(tiny_config(lora_rank=4, **layout), 2)  # the default targets: every stage's


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


def test_an_experts_linears_take_adapters_of_their_own_looped_or_grouped():
    """Each routed expert's fc1 / fc2 gets its own adapter (an expert parameter, named by the
    expert's global index); the expert computes ``base + alpha/r B A x`` by hand, and the
    grouped path (which reads the weights alone) computes adapted experts looped."""
    chunk = _chunk(num_experts=4, lora_rank=4, lora_alpha=8.0, swiglu=True)
    trained = {n: p for n, p in chunk.named_parameters() if p.requires_grad}
    experts = [n for n in trained if ".local_experts." in n]
    assert len(experts) == 2 * 4 * 2 * 2  # 2 layers x 4 experts x (fc1, fc2) x (A, B)
    assert all(getattr(trained[n], "allreduce", True) is False for n in experts)
    torch.manual_seed(0)
    with torch.no_grad():
        for name in experts:
            if name.endswith("linear_out.weight"):
                trained[name].normal_()
    expert = dict(chunk.named_modules())["decoder.layers.0.mlp.experts.local_experts.2"]
    x = torch.randn(5, expert.linear_fc1.weight.shape[1])
    with torch.no_grad():
        fc1 = expert.linear_fc1
        h = F.linear(x, fc1.weight) + 2.0 * (x @ fc1.adapter.linear_in.weight.t()
                                             @ fc1.adapter.linear_out.weight.t())
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
        fc2 = expert.linear_fc2
        by_hand = F.linear(h, fc2.weight) + 2.0 * (h @ fc2.adapter.linear_in.weight.t()
                                                   @ fc2.adapter.linear_out.weight.t())
        torch.testing.assert_close(expert(x), by_hand, rtol=1e-6, atol=1e-6)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    chunk.eval()
    with torch.no_grad():
        looped = chunk(tokens)
        for module in chunk.modules():
            if hasattr(module, "grouped"):
                module.grouped = True
        assert torch.equal(chunk(tokens), looped)


def test_experts_split_over_expert_tensor_parallelism_are_refused():
    config = tiny_config(num_experts=4, lora_rank=4, tensor_model_parallel_size=2)
    with pytest.raises(ConfigError, match=r"local_experts\.0\.linear_fc1 is an expert's "
                                          r"linear, split over expert tensor parallelism 2; "
                                          r"LoRA on experts needs --expert-tensor-parallel-size 1"):
        estimate_memory(config, 2)


CANONICAL = {"lora_rank": 4, "lora_alpha": 8.0, "swiglu": True, "num_query_groups": 2,
             "lora_target_modules": ["linear_q,linear_v,linear_fc1_up,linear_proj"]}


def test_canonical_adapters_add_each_projection_at_its_place_and_merge():
    """linear_q / linear_v / linear_fc1_up: one adapter per projection, its output at that
    projection's rows of the fused output (q, k, v per query group, as the Hugging Face import
    fuses them), nothing at k's or gate's; the merged weight computes the same."""
    from plugtron.plugins.transforms.lora import MergedLoRA
    from plugtron_gpt.gpt.hf_linears import split_qkv

    config = tiny_config(**CANONICAL)
    chunk = _chunk(**CANONICAL)
    modules = dict(chunk.named_modules())
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in chunk.named_parameters():
            if name.endswith("linear_out.weight"):
                param.normal_()
    heads, groups = config.model.num_attention_heads, 2
    state = {k: v.detach() for k, v in chunk.state_dict().items()}
    merged = MergedLoRA(state, 8.0 / 4, config.model)
    for name, parts in (("decoder.layers.0.self_attention.linear_qkv", ("q", None, "v")),
                        ("decoder.layers.1.mlp.linear_fc1", (None, "up"))):
        linear = modules[name]
        x = torch.randn(2, 5, linear.weight.shape[1])
        with torch.no_grad():
            added = (linear(x)[0] - F.linear(x, linear.weight)).reshape(10, -1).t()
        pieces = split_qkv(added, heads, groups) if "qkv" in name else added.chunk(2)
        for piece, part in zip(pieces, parts):
            if part is None:
                assert torch.equal(piece, torch.zeros_like(piece))
                continue
            adapter = getattr(linear.adapter, f"adapter_{part}")
            by_hand = 2.0 * (x @ adapter.linear_in.weight.t() @ adapter.linear_out.weight.t())
            torch.testing.assert_close(piece, by_hand.reshape(10, -1).t(), rtol=1e-5,
                                       atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(F.linear(x, merged[f"{name}.weight"]), linear(x)[0],
                                       rtol=1e-5, atol=1e-5)
    assert not [n for n in merged if "adapter" in n]


def test_canonical_targets_and_their_fused_linear_together_are_refused():
    with pytest.raises(ConfigError, match="names linear_qkv and its parts"):
        validate(tiny_config(lora_rank=4, lora_target_modules=["linear_qkv,linear_q"]), 1)
    with pytest.raises(ConfigError, match="is not a gated"):
        _chunk(lora_rank=4, lora_target_modules=["linear_fc1_gate"])
