"""Megatron-Core torch_dist checkpoints, without megatron-core: fixtures written with
torch.distributed.checkpoint in Megatron's key layout (megatron_fixtures.py) from a tiny plugtron
model; ``convert import-megatron`` gives back a model with the same logits (fp32, equal within
1e-6: the same weights, the same computation), whichever spec, key form and args; export and
import again keeps every tensor; hostile files are refused without running anything."""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
import pickle
import sys
import types

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.checkpoint import CheckpointReader, checkpointer, load_checkpoint
from plugtron.core.config_flags import apply_values
from plugtron.core.errors import CheckpointError
from plugtron.core.interchange.torch_dist import read_torch_dist
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.options import config_from_dict
from plugtron.core.training.loop import setup
from plugtron_gpt.layers.attention_options import AttentionOptions

from tests.core.checkpoint.helpers import ckpt_config, params_of
from tests.core.checkpoint.megatron_fixtures import megatron_keys, write_torch_dist

ONE = single_process()
VOCAB, SEQ, MEGATRON_VOCAB = 100, 16, 128
LLAMA = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
         "num_query_groups": 2, "untie_embeddings_and_output_weights": True,
         "add_bias_linear": False, "ffn_hidden_size": 48, "rotary_base": 5000}
GPT = {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
       "max_position_embeddings": 32}


class _AttnBackend(enum.Enum):
    """Stands in for Megatron's AttnBackend when megatron-core is absent: the saved args hold
    an enum, as Megatron's do (pickled under Megatron's module name, see _megatron_names)."""

    auto = 5


@contextlib.contextmanager
def _megatron_names():
    """Pickling the stand-in needs its module importable: fake Megatron's module path for
    the duration of the save only (so the megatron-core tests still skip when it is absent)."""
    try:
        from megatron.core.transformer.enums import AttnBackend  # noqa: F401
        yield
        return
    except ImportError:
        pass
    names = ["megatron", "megatron.core", "megatron.core.transformer",
             "megatron.core.transformer.enums"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules[names[-1]].AttnBackend = _AttnBackend
    _AttnBackend.__module__, _AttnBackend.__qualname__ = names[-1], "AttnBackend"
    try:
        yield
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module


def _attn_backend():
    try:
        from megatron.core.transformer.enums import AttnBackend
        return AttnBackend.auto
    except ImportError:
        return _AttnBackend.auto


def _source(settings: dict):
    """A tiny plugtron model with norms and biases away from 1 and 0, and its tensors."""
    run = setup(ckpt_config(seed=3, **settings), world=ONE)
    with torch.no_grad():
        for name, p in run.model_chunks[0].named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    params = params_of(run)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in params:
            params[name] = params[name][:VOCAB]
    return run, params


def _args(settings: dict, **extra):
    m = ckpt_config(**settings).model
    values = {k: getattr(m, k) for k in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
        "seq_length", "max_position_embeddings", "position_embedding_type", "rotary_base",
        "normalization", "norm_epsilon", "swiglu", "untie_embeddings_and_output_weights",
        "add_bias_linear")}
    values.update(vocab_size=VOCAB, padded_vocab_size=MEGATRON_VOCAB, hidden_dropout=0.2,
                  attention_dropout=0.1, make_vocab_size_divisible_by=128,
                  group_query_attention=bool(m.num_query_groups),
                  num_query_groups=m.num_query_groups or 1, params_dtype=torch.float32,
                  attention_backend=_attn_backend(), qk_layernorm=False, rotary_percent=1.0,
                  transformer_impl="transformer_engine", ckpt_format="torch_dist")
    values.update(extra)
    return argparse.Namespace(**values)


def _logits(run, tokens):
    model = run.model_chunks[0]
    model.eval()
    with torch.no_grad():
        return model(tokens)[..., :VOCAB].float()


def _run_for(path: str):
    config = config_from_dict(CheckpointReader(path).config)  # with the layers' options
    apply_values(config, {"data": "mock", "seq_length": SEQ, "hidden_dropout": 0.0,
                          "attention_dropout": 0.0, "micro_batch_size": 2,
                          "global_batch_size": 2, "train_iters": 1, "progress": False}, "test")
    config.model.padded_vocab_size = None
    run = setup(config, world=ONE)
    load_checkpoint(run, path, model_only=True)
    return run


QWEN2 = {**LLAMA, "add_qkv_bias": True, "rotary_seq_len_interpolation_factor": 2.0}
QWEN3_WINDOW = {**LLAMA, "qk_layernorm": True, "window_size": "5,0", "use_rope_scaling": True,
                "rope_scaling_factor": 4.0}
#: What Megatron saves for a GPT-2 (arguments.py): add_qkv_bias follows add_bias_linear, and
#: --openai-gelu is saved although Megatron-Core's GPTModel computes exact GeLU regardless.
GPT2_ARGS = {"add_qkv_bias": True, "openai_gelu": True}
CASES = {  # name: (model settings, fixture options, saved args (None: none), flags given)
    "llama-te-stacked": (LLAMA, {"spec": "te"}, {}, []),
    "llama-local-per-layer-split-fc1": (LLAMA, {"stacked": False, "split_fc1": True}, {}, []),
    "gpt-local-stacked-module-norms": (GPT, {"module_norms": True}, {}, []),
    "gpt-te-no-args": (GPT, {"spec": "te"}, None, ["--num-attention-heads", "4",
                                                   "--hidden-dropout", "0"]),
    "gpt2-args-openai-gelu": (GPT, {}, GPT2_ARGS, []),
    "qwen2-args": (QWEN2, {"spec": "te"}, {"add_qkv_bias": True,
                                           "rotary_seq_len_interpolation_factor": 2}, []),
    "gpt-args-squared-relu": ({**GPT, "squared_relu": True}, {}, {"squared_relu": True}, []),
    # Without args: q/k/v biases and q/k norms are seen in the tensors; the window and the rope
    # scaling leave none, so they are given (layer options are accepted after the directories).
    "qwen2-qwen3-no-args": ({**QWEN3_WINDOW, "add_qkv_bias": True}, {"stacked": False}, None,
                            ["--num-attention-heads", "4", "--num-query-groups", "2",
                             "--rotary-base", "5000", "--hidden-dropout", "0",
                             "--window-size", "5,0", "--use-rope-scaling",
                             "--rope-scaling-factor", "4"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_megatron_gives_the_same_logits(case, tmp_path):
    settings, options, extra_args, flags = CASES[case]
    with_args = extra_args is not None
    run, params = _source(settings)
    state = megatron_keys(params, run.config.model.num_layers, padded_vocab=MEGATRON_VOCAB,
                          **options)
    with _megatron_names():
        write_torch_dist(str(tmp_path / "mcore"), 7, state,
                         _args(settings, **extra_args) if with_args else None)
    out = str(tmp_path / "imported")
    result = CliRunner().invoke(cli, ["convert", "import-megatron", str(tmp_path / "mcore"), out,
                                      *flags])
    assert result.exit_code == 0, result.output
    imported = _run_for(out)
    m = imported.config.model
    assert (m.normalization, m.swiglu, m.num_query_groups) == (
        settings["normalization"], settings.get("swiglu", False),
        settings.get("num_query_groups"))
    assert m.vocab_size == (VOCAB if with_args else MEGATRON_VOCAB)
    saved = CheckpointReader(out).config["model"]
    # The saved args win over plugtron's defaults; flags given win over the saved args.
    assert saved["hidden_dropout"] == (0.2 if with_args else 0.0)
    sections = CheckpointReader(out).config
    for name in ("add_qkv_bias", "qk_layernorm", "window_size", "use_rope_scaling",
                 "rope_scaling_factor", "openai_gelu"):
        assert sections["attention" if name != "openai_gelu" else "mlp"][name] == \
            settings.get(name, AttentionOptions().__dict__.get(name, False)), name
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(imported, tokens), _logits(run, tokens), rtol=0,
                               atol=1e-6)


@pytest.mark.parametrize("settings", [LLAMA, {**QWEN3_WINDOW, "add_qkv_bias": True}],
                         ids=["llama", "qwen3-window-rope-scaling"])
def test_export_megatron_then_import_keeps_every_tensor(settings, tmp_path):
    run = setup(ckpt_config(save=str(tmp_path / "save"), **settings), world=ONE)
    checkpointer(run).save(0)
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", "export-megatron", str(tmp_path / "save"),
                                 str(tmp_path / "mcore")])
    assert result.exit_code == 0, result.output
    ckpt = read_torch_dist(str(tmp_path / "mcore"))
    assert ckpt.common["args"].num_layers == 2 and ckpt.common["args"].swiglu is True
    assert ckpt.tensors["decoder.layers.self_attention.linear_qkv.weight"].shape[0] == 2
    result = runner.invoke(cli, ["convert", "import-megatron", str(tmp_path / "mcore"),
                                 str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    before, after = CheckpointReader(str(tmp_path / "save")), CheckpointReader(
        str(tmp_path / "again"))
    assert before.config["attention"] == after.config["attention"]
    if "window_size" in settings:  # in Megatron's own forms
        args = ckpt.common["args"]
        assert (args.window_size, args.qk_layernorm, args.add_qkv_bias, args.use_rope_scaling,
                args.rope_scaling_factor) == ((5, 0), True, True, True, 4.0)
    assert before.names("model/") == after.names("model/")
    for name in before.names("model/"):
        a, b = before.read_full(f"model/{name}"), after.read_full(f"model/{name}")
        if "word_embeddings" in name or "output_layer" in name:
            a, b = a[:VOCAB], b[:VOCAB]
        assert torch.equal(a, b), name


@pytest.mark.parametrize("flags,message", [
    ({"openai_gelu": True}, "computes exact GeLU whatever --openai-gelu says"),
    ({"position_embedding_type": "rope", "use_rope_scaling": True,
      "rope_scaling_high_freq_factor": 2.0}, "fixes it at 4.0"),
])
def test_export_megatron_refuses_what_megatron_core_cannot_compute(flags, message, tmp_path):
    run = setup(ckpt_config(save=str(tmp_path / "save"), **flags), world=ONE)
    checkpointer(run).save(0)
    result = CliRunner().invoke(cli, ["convert", "export-megatron", str(tmp_path / "save"),
                                      str(tmp_path / "mcore")])
    assert result.exit_code == 2 and message in result.output, result.output


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _fixture(tmp_path) -> str:
    run, params = _source(GPT)
    with _megatron_names():
        return write_torch_dist(str(tmp_path / "mcore"), 1,
                                megatron_keys(params, 2, padded_vocab=MEGATRON_VOCAB),
                                _args(GPT))


@pytest.mark.parametrize("target", [".metadata", "common.pt"])
def test_a_pickle_that_runs_code_is_refused(target, tmp_path):
    directory = _fixture(tmp_path)
    evil = _Evil()
    evil.marker = str(tmp_path / "pwned")
    path = os.path.join(directory, target)
    if target == "common.pt":
        torch.save({"args": evil}, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(evil, f)
    result = CliRunner().invoke(cli, ["convert", "import-megatron", str(tmp_path / "mcore"),
                                      str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "system" in result.output and "refused" in result.output
    assert not os.path.exists(evil.marker)


def test_damaged_files_and_unknown_features_are_clear_errors(tmp_path):
    directory = _fixture(tmp_path)
    runner = CliRunner()
    ckpt = read_torch_dist(directory)
    key = "embedding.word_embeddings.weight"
    storage = ckpt.tensors[key].chunks[0][2]
    storage.state["length"] = 10 ** 12  # past the end of the shard file
    with pytest.raises(CheckpointError, match="bytes"):
        ckpt.read(key)
    shard = os.path.join(directory, storage.field("relative_path"))
    with open(shard, "r+b") as f:
        f.truncate(8)
    result = runner.invoke(cli, ["convert", "import-megatron", directory, str(tmp_path / "o")])
    assert result.exit_code == 2 and "CheckpointError" not in result.output, result.output
    assert "distcp" in result.output
    # A model feature plugtron's GPT lacks is refused by name, not converted into another model.
    run, params = _source(GPT)
    with _megatron_names():
        write_torch_dist(str(tmp_path / "qk"), 1, megatron_keys(params, 2),
                         _args(GPT, qk_l2_norm=True))
    result = runner.invoke(cli, ["convert", "import-megatron", str(tmp_path / "qk"),
                                 str(tmp_path / "o2")])
    assert result.exit_code == 2 and "qk_l2_norm" in result.output, result.output
    for i, (extra, message) in enumerate([
            ({"window_size": (5, 2)}, "window_size=(5, 2)"),
            ({"window_size": (5, 0), "window_attn_skip_freq": 2}, "window_attn_skip_freq=2"),
            ({"rotary_interleaved": True}, "rotary_interleaved=True"),
            ({"num_experts": 4}, "num_experts=4")]):
        with _megatron_names():
            write_torch_dist(str(tmp_path / f"f{i}"), 1, megatron_keys(params, 2),
                             _args(GPT, **extra))
        result = runner.invoke(cli, ["convert", "import-megatron", str(tmp_path / f"f{i}"),
                                     str(tmp_path / f"o{i}")])
        assert result.exit_code == 2 and message in result.output, result.output
    # Partial rotary is a GPT option now (--rotary-percent): taken over, not refused.
    with _megatron_names():
        write_torch_dist(str(tmp_path / "partial"), 1, megatron_keys(params, 2),
                         _args(GPT, rotary_percent=0.5))
    result = runner.invoke(cli, ["convert", "import-megatron", str(tmp_path / "partial"),
                                 str(tmp_path / "o-partial")])
    assert result.exit_code == 0 and "--rotary-percent 0.5" in result.output, result.output


def test_multi_latent_attention_and_mtp_export_and_import_keep_every_tensor(tmp_path):
    """MLA (query compression) and two MTP layers on a dense GPT: Megatron's names (the latent
    norms fused into the up-projections as the TE spec saves them, MTP's transformer_layer),
    layers stacked, and back bit for bit; every tensor drawn at random so that no two norms can
    be swapped unnoticed. Without query compression the export is refused by name (Megatron-Core
    0.19 would normalise the hidden state again before linear_q_proj)."""
    settings = {**LLAMA, "num_query_groups": None, "multi_latent_attention": True,
                "q_lora_rank": 12, "kv_lora_rank": 8,
                "qk_head_dim": 6, "qk_pos_emb_head_dim": 4, "v_head_dim": 5,
                "mtp_num_layers": 2}
    run = setup(ckpt_config(save=str(tmp_path / "save"), **settings), world=ONE)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for t in run.model_chunks[0].module.state_dict(keep_vars=True).values():
            t.copy_(torch.randn(t.shape, generator=gen))
    checkpointer(run).save(0)
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", "export-megatron", str(tmp_path / "save"),
                                 str(tmp_path / "mcore")])
    assert result.exit_code == 0, result.output
    ckpt = read_torch_dist(str(tmp_path / "mcore"))
    args = ckpt.common["args"]
    assert (args.multi_latent_attention, args.qk_layernorm, args.q_lora_rank,
            args.rope_type, args.mtp_num_layers) == (True, True, 12, "rope", 2)
    attn = "decoder.layers.self_attention"
    assert tuple(ckpt.tensors[f"{attn}.linear_q_up_proj.layer_norm_weight"].shape) == (2, 12)
    assert tuple(ckpt.tensors[f"{attn}.linear_kv_up_proj.layer_norm_weight"].shape) == (2, 8)
    assert "decoder.layers.input_layernorm.weight" in ckpt.tensors
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in ckpt.tensors
    assert "mtp.layers.1.transformer_layer.self_attention.linear_kv_down_proj.weight" in \
        ckpt.tensors and "mtp.layers.1.eh_proj._extra_state/shard_0_1" in ckpt.objects
    result = runner.invoke(cli, ["convert", "import-megatron", str(tmp_path / "mcore"),
                                 str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    before, after = CheckpointReader(str(tmp_path / "save")), CheckpointReader(
        str(tmp_path / "again"))
    assert {k: v for k, v in before.config["attention"].items() if v is not None} == \
        {k: v for k, v in after.config["attention"].items() if v is not None}
    assert before.config["mtp"] == after.config["mtp"]
    assert before.names("model/") == after.names("model/")
    for name in before.names("model/"):
        a, b = before.read_full(f"model/{name}"), after.read_full(f"model/{name}")
        if "word_embeddings" in name or "output_layer" in name:
            a, b = a[:VOCAB], b[:VOCAB]
        assert torch.equal(a, b), name
    no_q = {**settings, "q_lora_rank": None}
    run = setup(ckpt_config(save=str(tmp_path / "no_q"), **no_q), world=ONE)
    checkpointer(run).save(0)
    result = runner.invoke(cli, ["convert", "export-megatron", str(tmp_path / "no_q"),
                                 str(tmp_path / "refused")])
    assert result.exit_code == 2 and "linear_q_proj.layer_norm_weight" in result.output, \
        result.output
