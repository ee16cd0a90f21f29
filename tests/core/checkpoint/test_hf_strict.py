"""Strict Hugging Face import (core/interchange/hf_strict.py): a file that disagrees with its
config.json is refused with exit 2 and a message naming the tensor (or the file and the key),
never converted silently and never a traceback. One tiny Llama (vocabulary 1000, GQA) is made
once; each case edits a copy of it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.checkpoint import CheckpointReader
from plugtron.core.errors import ConfigError
from plugtron.core.training.validate import validate
from safetensors.torch import load_file, save_file

from tests.utils import tiny_config

transformers = pytest.importorskip("transformers")

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    path = str(tmp_path_factory.mktemp("hf") / "llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _copy(src, root, name):
    target = os.path.join(str(root), name)
    shutil.copytree(src, target)
    return target


def _tensors(target, change):
    file = os.path.join(target, WEIGHTS)
    tensors = load_file(file)
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, file)


def _config(target, change):
    file = os.path.join(target, "config.json")
    with open(file) as f:
        config = json.load(f)
    config = change(config)
    with open(file, "w") as f:
        f.write(config if isinstance(config, str) else json.dumps(config))


def _import(target):
    result = CliRunner().invoke(cli, ["convert", "import-hf", target, target + "-out"])
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        "traceback", result.output, result.exception)
    return result


def test_clean_model_converts(llama_dir, tmp_path):
    result = _import(_copy(llama_dir, tmp_path, "clean"))
    assert result.exit_code == 0, result.output
    # pad_token_id -1 (some published configs): tolerated, as transformers does, not recorded
    odd = _copy(llama_dir, tmp_path, "pad-minus-1")
    _config(odd, lambda c: {**c, "pad_token_id": -1, "eos_token_id": 2})
    assert _import(odd).exit_code == 0
    model = CheckpointReader(odd + "-out").config["model"]
    assert model["pad_token_id"] is None and model["eos_token_id"] == 2


def test_token_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ConfigError, match="--eos-token-id 100 is not a token id"):
        validate(tiny_config(eos_token_id=100), world_size=1)


def _set(key, value):
    return lambda t: t.__setitem__(key, value)


L0 = "model.layers.0"
TENSOR_CASES = {
    # A transposed k_proj [16, 32] -> [32, 16] reshapes silently into the fused QKV.
    "transposed-k": (lambda t: t.__setitem__(f"{L0}.self_attn.k_proj.weight",
                                             t[f"{L0}.self_attn.k_proj.weight"].t()),
                     [f"{L0}.self_attn.k_proj.weight", "transposed"]),
    "embedding-900-rows": (lambda t: t.__setitem__("model.embed_tokens.weight",
                                                   t["model.embed_tokens.weight"][:900]),
                           ["model.embed_tokens.weight", "900"]),
    "embedding-1100-rows": (lambda t: t.__setitem__(
        "model.embed_tokens.weight", torch.cat([t["model.embed_tokens.weight"]] * 2)[:1100]),
        ["model.embed_tokens.weight", "1100"]),
    "padded-o-proj": (lambda t: t.__setitem__(f"{L0}.self_attn.o_proj.weight", torch.zeros(32, 40)),
                      [f"{L0}.self_attn.o_proj.weight", "[32, 40]"]),
    "unused-tensor": (_set(f"{L0}.self_attn.extra.weight", torch.zeros(4)),
                      [f"{L0}.self_attn.extra.weight", "not part of the model"]),
    "missing-norm": (lambda t: t.pop("model.norm.weight"), ["model.norm.weight"]),
    "wrong-norm": (_set(f"{L0}.input_layernorm.weight", torch.ones(31)),
                   [f"{L0}.input_layernorm.weight"]),
}


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_disagreeing_tensors_are_refused(llama_dir, tmp_path, case):
    change, words = TENSOR_CASES[case]
    target = _copy(llama_dir, tmp_path, case)
    _tensors(target, change)
    result = _import(target)
    assert result.exit_code == 2, result.output
    for word in words:
        assert word in result.output, result.output
    assert not os.path.exists(target + "-out")


def test_layer_count_disagreeing_is_refused(llama_dir, tmp_path):
    fewer = _copy(llama_dir, tmp_path, "fewer")
    _config(fewer, lambda c: {**c, "num_hidden_layers": 1})
    result = _import(fewer)
    assert result.exit_code == 2 and "model.layers.1." in result.output, result.output
    assert "layer count" in result.output
    more = _copy(llama_dir, tmp_path, "more")
    _config(more, lambda c: {**c, "num_hidden_layers": 3})
    result = _import(more)
    assert result.exit_code == 2 and "model.layers.2." in result.output, result.output


CONFIG_CASES = {
    "not-json": lambda c: "{oops",
    "list": lambda c: [c],
    "heads-string": lambda c: {**c, "num_attention_heads": "four"},
    "hidden-null": lambda c: {**c, "hidden_size": None},
    "no-vocab": lambda c: {k: v for k, v in c.items() if k != "vocab_size"},
    "groups-3": lambda c: {**c, "num_key_value_heads": 3},
    "layers-negative": lambda c: {**c, "num_hidden_layers": -1},
    "eps-string": lambda c: {**c, "rms_norm_eps": "small"},
    "ffn-float": lambda c: {**c, "intermediate_size": 48.5},
}


def _index(target, weight_map):
    os.rename(os.path.join(target, WEIGHTS), os.path.join(target, "shard-1.safetensors"))
    with open(os.path.join(target, "model.safetensors.index.json"), "w") as f:
        f.write(weight_map if isinstance(weight_map, str) else json.dumps(weight_map))


INDEX_CASES = {
    "index-not-json": "[1,",
    "index-no-map": {"metadata": {}},
    "index-map-list": {"weight_map": ["shard-1.safetensors"]},
    "index-int-file": {"weight_map": {"model.norm.weight": 7}},
    "index-missing-file": {"weight_map": {"model.norm.weight": "shard-2.safetensors"}},
}


def test_malformed_config_and_index_exit_2(llama_dir, tmp_path):
    failures = []
    for name, change in CONFIG_CASES.items():
        target = _copy(llama_dir, tmp_path, name)
        _config(target, change)
        result = _import(target)
        if result.exit_code != 2 or "config.json" not in result.output:
            failures.append((name, result.exit_code, result.output))
    for name, weight_map in INDEX_CASES.items():
        target = _copy(llama_dir, tmp_path, name)
        _index(target, weight_map)
        result = _import(target)
        if result.exit_code != 2 or "index.json" not in result.output and "shard" not in \
                result.output:
            failures.append((name, result.exit_code, result.output))
    assert not failures, failures
