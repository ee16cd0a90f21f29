"""The Hybrid model in one process: Megatron-Core's parameter names, the pattern's rules and
the size checks (exit 2 before launch), model info."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.plugins import registry
from plugtron.core.training.loop import finalize_model_config
from plugtron.testing import make_config
from plugtron_gpt.hybrid.pattern import chunk_of
from plugtron_gpt.hybrid.sizes import validate_hybrid

MAMBA = {"model": "hybrid", "mamba-state-dim": 8, "mamba-head-dim": 8, "mamba-num-groups": 2,
         "mamba-chunk-size": 4}


def build(**flags):
    config = make_config({**MAMBA, **flags})
    parallel = ParallelContext.build(1, 0)
    finalize_model_config(config, parallel)
    backend = registry.load("layer_backend", "local")(config, parallel)
    plugin = registry.instantiate(registry.load("model", "hybrid"))
    model = plugin.model_provider(config=config, pre_process=True, post_process=True,
                                  vp_stage=None, layer_backend=backend, parallel=parallel)
    return config, model, plugin


def test_megatron_core_parameter_names():
    _, model, _ = build(**{"hybrid-layer-pattern": "M*-M-", "num-layers": 5})
    names = set(dict(model.named_parameters()))
    mixer = "decoder.layers.0.mixer"
    for suffix in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias",
                   "norm.weight", "out_proj.weight"):
        assert f"{mixer}.{suffix}" in names
    assert "decoder.layers.0.norm.weight" in names
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in names
    assert "decoder.layers.1.input_layernorm.weight" in names
    assert "decoder.layers.2.mlp.linear_fc1.weight" in names
    assert "decoder.layers.3.mixer.in_proj.weight" in names
    assert "decoder.layers.4.pre_mlp_layernorm.weight" in names
    assert {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"} <= names
    assert not any("position_embeddings" in n for n in names)
    # in_proj: [z, x, B, C, dt] = 64 + 64 + 16 + 16 + 8 rows
    in_proj = dict(model.named_parameters())[f"{mixer}.in_proj.weight"]
    assert in_proj.shape == (168, 32) and in_proj.partition_chunks == (64, 64, 16, 16, 8)


def test_forward_and_backward_are_finite_at_a_length_off_the_chunk():
    config, model, _ = build(**{"hybrid-layer-pattern": "M-", "num-layers": 2,
                                "seq-length": 11})
    tokens = torch.randint(0, 100, (2, 11))
    loss = model(tokens, labels=tokens)
    loss.sum().backward()
    assert torch.isfinite(loss).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_fused_output_loss_is_the_hybrid_models_option_too():
    flags = {"hybrid-layer-pattern": "M*", "num-layers": 2}
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    for fused in (False, True):
        torch.manual_seed(0)
        config, model, _ = build(**flags, **{"cross-entropy-loss-fusion": fused})
        assert config.model.cross_entropy_loss_fusion is fused
        losses.append(model(tokens, labels=tokens))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)


def test_pattern_segments_place_layers():
    assert chunk_of("M*-|M", 2, 0, None, None) == range(0, 3)
    assert chunk_of("M*-|M", 2, 1, None, None) == range(3, 4)
    # segment index = vp_stage x pp + pp_rank
    assert chunk_of("M|*|-|M", 2, 1, 2, 0) == range(1, 2)
    assert chunk_of("M|*|-|M", 2, 0, 2, 1) == range(2, 3)
    assert chunk_of("M*-M", 2, 1, None, None) == range(2, 4)


@pytest.mark.parametrize("flags,message", [
    ({"hybrid-layer-pattern": "M*-M-", "num-layers": 6}, "--num-layers 6 differs from the 5"),
    ({"hybrid-layer-pattern": "M*||M"}, "empty pipeline segment"),
    ({"hybrid-layer-pattern": "MX"}, "no layer type for symbol(s) X"),
    ({"hybrid-layer-pattern": "M*|M", "pp": 2, "vp": 2}, "has 2 pipeline segments"),
    ({"hybrid-layer-pattern": "MM", "mamba-num-groups": 3}, "not divisible by --mamba-num-groups"),
    ({"hybrid-layer-pattern": "MM", "tp": 2, "mamba-num-groups": 1},
     "--mamba-num-groups 1 is not divisible by --tp 2"),
    ({"hybrid-layer-pattern": "MM", "tp": 3, "mamba-num-groups": 1},
     "Mamba heads 8 are not divisible by --tp 3"),
    ({"hybrid-layer-pattern": "M*", "cp": 2}, "context parallelism is not supported with Mamba"),
])
def test_refusals(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_hybrid(make_config({**MAMBA, **flags}))


def test_cli_refuses_before_launch_with_exit_2():
    result = CliRunner().invoke(cli, ["train", "--model", "hybrid", "--data", "mock",
                                      "--hybrid-override-pattern", "M*-|M-", "--pp", "2",
                                      "--vp", "2", "--nproc-per-node", "4"],
                                catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "has 2 pipeline segments; --pp 2 x --vp 2 needs 4" in result.output
    assert "Traceback" not in result.output


def test_model_info_names_the_architecture():
    config = make_config({**MAMBA, "hybrid-layer-pattern": "M*|-M"})
    info = registry.instantiate(registry.load("model", "hybrid")).model_info(config)
    arch = info.architecture
    assert info.places_layers and info.main_loss == "lm loss"
    assert arch["--hybrid-layer-pattern"] == "M*-M"  # boundaries do not change the weights
    assert (arch["--mamba-num-heads"], arch["--mamba-num-groups"], arch["--num-layers"]) == (8, 2, 4)


def test_squared_relu_changes_the_mlp_and_refuses_swiglu():
    losses = []
    for flag in (False, True):
        config, model, _ = build(**{"hybrid-layer-pattern": "-", "num-layers": 1,
                                    "squared-relu": flag})
        tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
        losses.append(model(tokens, labels=tokens).mean().item())
    assert losses[0] != losses[1]
    assert registry.instantiate(registry.load("model", "hybrid")).model_info(
        config).architecture["--squared-relu"] is True
    from plugtron_gpt.layers.mlp import MLPLayer

    with pytest.raises(ConfigError, match="--squared-relu and --swiglu"):
        MLPLayer.plugtron_validate(make_config({"squared-relu": True, "swiglu": True}))


def test_console_header_counts_the_patterns_layers(capsys):
    """The header's layer count comes from the model (ModelInfo.architecture), so a pattern of
    five layers reads 5 whatever the core's --num-layers default is."""
    from types import SimpleNamespace

    from plugtron.plugins.extensions.console_log import ConsoleLog

    config = make_config({**MAMBA, "hybrid-layer-pattern": "M*-M-", "data": "mock",
                          "vocab-size": 64})
    assert config.model.num_layers != 5
    ConsoleLog().plugtron_train_start(config=config, state=SimpleNamespace(iteration=0))
    assert "plugtron: 5 layers, hidden" in capsys.readouterr().out
