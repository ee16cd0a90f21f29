"""``--load HF_DIR`` (train, evaluate, load_model) and the details of ``convert export-hf``
(bos/eos/pad, generation_config.json, tokenizer files, shards + index, fp32 master weights).
One tiny Llama with its own special ids, made once; the import cache is a temporary folder."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.checkpoint import CheckpointReader
from plugtron.core.parallel.distributed import single_process
from plugtron.core.tools.inference import load_model
from safetensors.torch import load_file

from tests.tokenizer_helpers import save_tiny_hf_tokenizer

from .helpers import ckpt_config, train_resumable

transformers = pytest.importorskip("transformers")

ONE = single_process()
VOCAB = 64
RUN = ["--data", "mock", "--seq-length", "16", "--micro-batch-size", "2",
       "--global-batch-size", "2", "--eval-iters", "1", "--no-progress"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfload")
    os.environ["PLUGTRON_HF_CACHE"] = str(root / "cache")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
        bos_token_id=3, eos_token_id=4, pad_token_id=5, initializer_range=0.2)
    model = transformers.LlamaForCausalLM(config).eval()
    path = str(root / "llama")
    model.save_pretrained(path)
    yield path, model, root
    os.environ.pop("PLUGTRON_HF_CACHE", None)


def test_load_model_reads_an_hf_dir(hf):
    path, model, root = hf
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = load_model(path)(tokens)
    with torch.no_grad():
        theirs = model(tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    m = load_model(path).config.model  # cached: the same import again
    assert (m.hidden_dropout, m.attention_dropout) == (0.0, 0.0)  # Llama has no dropout
    assert (m.bos_token_id, m.eos_token_id, m.pad_token_id) == (3, 4, 5)
    assert m.max_position_embeddings == 48
    assert len(os.listdir(os.environ["PLUGTRON_HF_CACHE"])) == 1


def test_train_and_evaluate_load_hf_dir(hf, tmp_path):
    path, _, _ = hf
    runner = CliRunner()
    save = str(tmp_path / "save")
    result = runner.invoke(cli, ["train", "--load", path, "--save", save, "--train-iters", "1",
                                 *RUN])
    assert result.exit_code == 0, result.output
    saved = CheckpointReader(save).config["model"]
    assert saved["hidden_size"] == 32 and saved["num_query_groups"] == 2
    assert saved["eos_token_id"] == 4 and saved["hidden_dropout"] == 0.0
    result = runner.invoke(cli, ["evaluate", "--load", path, *RUN])
    assert result.exit_code == 0 and "mock: lm loss" in result.output, result.output


def test_contradicting_flag_exits_2(hf, tmp_path):
    path, _, _ = hf
    for command in ("train", "evaluate"):
        result = CliRunner().invoke(cli, [command, "--load", path, "--hidden-size", "64",
                                          "--train-iters", "1", *RUN])
        assert result.exit_code == 2, result.output
        assert "--hidden-size 64" in result.output and "--hidden-size 32" in result.output
        assert "config.json" in result.output


def test_export_shards_ids_and_reload(hf, tmp_path):
    path, model, _ = hf
    runner = CliRunner()
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert runner.invoke(cli, ["convert", "import-hf", path, ckpt]).exit_code == 0
    result = runner.invoke(cli, ["convert", "export-hf", ckpt, out, "--max-shard-size", "20KB"])
    assert result.exit_code == 0, result.output
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(os.path.getsize(os.path.join(out, s)) < 40_000
                                   for s in shards)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "generation_config.json")) as f:
        generation = json.load(f)
    for data in (config, generation):
        assert (data["bos_token_id"], data["eos_token_id"], data["pad_token_id"]) == (3, 4, 5)
    back = transformers.LlamaForCausalLM.from_pretrained(out)
    assert back.generation_config.eos_token_id == 4
    original = model.state_dict()
    for name, value in back.state_dict().items():
        assert torch.equal(value, original[name]), name
    result = runner.invoke(cli, ["convert", "export-hf", ckpt, str(tmp_path / "o2"),
                                 "--max-shard-size", "lots"])
    assert result.exit_code == 2 and "--max-shard-size" in result.output


def test_export_fp32_master_weights_and_tokenizer(tmp_path):
    tok = save_tiny_hf_tokenizer(tmp_path / "tok")
    save = str(tmp_path / "save")
    config = ckpt_config(save=str(save), train_iters=1, bf16=True, vocab_size=None,
                         tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tok),
                         normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                         add_bias_linear=False, untie_embeddings_and_output_weights=True)
    train_resumable(config, ONE)
    out = str(tmp_path / "out")
    result = CliRunner().invoke(cli, ["convert", "export-hf", save, out, "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["eos_token_id"] == 1  # the tokenizer's eos
    weights = load_file(os.path.join(out, "model.safetensors"))
    reader = CheckpointReader(save)
    master = reader.read_full("optim/decoder.layers.0.self_attention.linear_proj.weight/"
                              "main_param")
    model = reader.read_full("model/decoder.layers.0.self_attention.linear_proj.weight")
    exported = weights["model.layers.0.self_attn.o_proj.weight"]
    assert model.dtype == torch.bfloat16 and exported.dtype == torch.float32
    assert torch.equal(exported, master) and not torch.equal(exported, model.float())



def test_a_fine_tune_starts_from_an_hf_dir(hf, tmp_path):
    """``--pretrained-checkpoint HF_DIR --finetune``: the model settings come from config.json
    as for ``--load``; the LoRA fine-tune saves its adapters, naming the imported base."""
    path, _, _ = hf
    save = str(tmp_path / "ft")
    result = CliRunner().invoke(cli, ["train", "--pretrained-checkpoint", path, "--finetune",
                                      "--lora-rank", "4", "--save", save, "--train-iters", "1",
                                      *RUN])
    assert result.exit_code == 0, result.output
    reader = CheckpointReader(save)
    assert reader.config["model"]["hidden_size"] == 32
    assert all(".adapter." in n for n in reader.tensors if n.startswith("model/"))
    base = reader.metadata["base_checkpoint"]
    assert base["path"].startswith(os.environ["PLUGTRON_HF_CACHE"]), base
