"""Hugging Face ``deepseek_v3`` interchange (plugtron-moe's DeepseekV3Converter): tiny random
DeepSeek-V3 models built from configs (no downloads) with dense layers first then MoE
(``first_k_dense_replace``), sigmoid routing with a random expert bias, group-limited top-k, the
routed scaling factor and a shared expert; query compression on and off; YaRN rope; multi-token
prediction layers present (written as DeepSeek stores them, ``model.layers.{L + k}``) and absent.

* plugtron's logits equal transformers' DeepseekV3ForCausalLM within 1e-5 (fp32), and each
  MTP depth's logits equal transformers' ``MtpModel`` (its speculative-decoding module, run on
  the same weights) on the positions both compute;
* export after import gives back every tensor of the files bit for bit, and importing the export
  gives back the same checkpoint;
* a model made by plugtron (MLA + MoE + MTP + YaRN) exports as deepseek_v3 that transformers
  runs to the same logits, and without its MTP layer under ``--drop mtp``; ``--load HF_DIR``
  trains one directly (MTP loss reported);
* config fields plugtron would compute differently, or does not know, exit 2 naming them.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.core.checkpoint.hf_models import (
    assert_exports_back,
    assert_same_checkpoint_tensors,
    convert,
    logits_of,
    run_for,
    save_random,
    tokens,
)

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 100, 16
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_shared_experts=1, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=12,
            qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=6, max_position_embeddings=64,
            routed_scaling_factor=2.5, initializer_range=0.2, num_nextn_predict_layers=0)
#: DeepSeek-V3's own YaRN (factor 40, mscale = mscale_all_dim = 1), its original context shrunk
#: so that the ramp falls inside the rotary channels.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1}

#: case -> (config changes, MTP depth written to the files)
CASES = {
    "dense-first-q-lora-groups": ({}, 0),
    "no-q-lora-no-groups": ({"q_lora_rank": None, "n_group": 1, "topk_group": 1,
                             "num_experts_per_tok": 2, "n_shared_experts": 2}, 0),
    "yarn": ({"rope_parameters": YARN, "first_k_dense_replace": 2}, 0),
    "mtp": ({"num_nextn_predict_layers": 1}, 1),
    "mtp2-tied-yarn-no-q-lora": ({"num_nextn_predict_layers": 2, "tie_word_embeddings": True,
                                  "rope_parameters": YARN, "q_lora_rank": None}, 2),
}


def _randomize_bias(module) -> None:
    """The routers' correction biases (buffers, zero at init) away from zero."""
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)


def make_hf(changes: dict, depth: int, directory: str):
    """A random DeepseekV3ForCausalLM saved to ``directory``, plus ``depth`` MTP layers of a
    random transformers ``MtpModel`` written as DeepSeek stores them. Returns (model, mtp)."""
    config = transformers.DeepseekV3Config(**{**BASE, **changes})
    model = save_random(transformers.DeepseekV3ForCausalLM, config, directory)
    _randomize_bias(model)
    model.save_pretrained(directory)
    if not depth:
        return model, None
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(1)
    mtp = MtpModel(model, depth)
    with torch.no_grad():  # its own init leaves experts empty and routers zero
        for name, p in mtp.named_parameters():
            if not name.startswith(("embed_tokens", "shared_head")):
                p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name
                        else 0.2 * torch.randn_like(p))
    _randomize_bias(mtp)
    mtp.eval()
    layers = config.num_hidden_layers
    path = os.path.join(directory, "model.safetensors")
    files = load_file(path)
    for name, value in mtp.state_dict().items():
        if not name.startswith("layers."):
            continue
        _, k, rest = name.split(".", 2)
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        files[f"model.layers.{layers + int(k)}.{rest}"] = value.contiguous()
    for k in range(depth):  # DeepSeek's files hold the MTP layer's own copies of both
        files[f"model.layers.{layers + k}.embed_tokens.weight"] = model.model.embed_tokens.weight
        files[f"model.layers.{layers + k}.shared_head.head.weight"] = model.lm_head.weight
    save_file({k: v.detach().clone().contiguous() for k, v in files.items()}, path,
              metadata={"format": "pt"})
    return model, mtp


def _network(path: str):
    chunk = run_for(path, SEQ).model_chunks[0]
    chunk.eval()
    net = chunk
    while not hasattr(net, "mtp"):
        net = net.module
    return net


def mtp_logits_pair(path: str, model, mtp, batch) -> list[tuple]:
    """Per depth k: (plugtron's MTP logits, transformers' MtpModel logits) on the positions
    both compute (plugtron shifts the tokens in place, the last k places padded; transformers
    takes the k-times shifted tokens and hidden states, rotary at the shifted positions, which
    leaves attention unchanged)."""
    from plugtron.core.blocks.rotary import rotary_freqs_at
    from plugtron_gpt.gpt.mtp import roll_left

    net = _network(path)
    s = batch.shape[1]
    out = []
    with torch.no_grad():
        positions = torch.arange(s).expand_as(batch)
        rotary = rotary_freqs_at(positions, net.head_dim, net.config.model.rotary_base,
                                 net.rope_scaling)
        ours = net.decoder(net.embedding(batch, positions), rotary)
        theirs = model.model(batch).last_hidden_state
        ids, shifted = batch, positions
        for k, layer in enumerate(net.mtp.layers):
            ids, shifted = roll_left(ids), roll_left(shifted)
            ours = layer(ours, net.embedding(ids, shifted), rotary)
            logits = net.backend.output_logits(ours, net.output_weight(), False)[..., :VOCAB]
            theirs = mtp.forward_layer(k, theirs[:, :-1], torch.arange(k + 1, s)[None], None,
                                       input_ids=batch[:, k + 1:])
            out.append((logits[:, :s - 1 - k], model.lm_head(theirs)))
    return out


def _hf_tensors(directory: str) -> dict:
    tensors = {}
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


@pytest.mark.parametrize("case", list(CASES))
def test_import_gives_transformers_logits_and_exports_back(case, tmp_path):
    changes, depth = CASES[case]
    hf_dir, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    model, mtp = make_hf(changes, depth, hf_dir)
    result = convert("import-hf", hf_dir, ckpt)
    assert "--multi-latent-attention" in result.output
    assert ("--q-lora-rank" in result.output) == (changes.get("q_lora_rank", 12) is not None)
    assert ("--rope-type yarn" in result.output) == ("rope_parameters" in changes)
    assert (f"--mtp-num-layers {depth}" in result.output) == bool(depth)

    batch = tokens(VOCAB, (2, SEQ))
    ours = logits_of(ckpt, batch, VOCAB)
    with torch.no_grad():
        theirs = model(batch).logits.float()
    assert theirs.std() > 0.1
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    for mine, reference in mtp_logits_pair(ckpt, model, mtp, batch) if depth else []:
        assert reference.std() > 0.1
        assert torch.allclose(mine, reference, atol=1e-5, rtol=0), \
            (mine - reference).abs().max()

    assert_exports_back(model, ckpt, back)  # the decoder, through transformers
    source, exported = _hf_tensors(hf_dir), _hf_tensors(back)
    for name in source:  # every tensor of the files, the MTP layers' too
        if ".experts." in name and ".shared_experts." not in name:
            continue  # per-expert in the source, fused in the export: compared just below
        assert torch.equal(exported[name], source[name]), name
    with open(os.path.join(back, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == depth
    convert("import-hf", back, str(tmp_path / "again"))  # fused experts read back
    assert_same_checkpoint_tensors(ckpt, str(tmp_path / "again"), VOCAB)


def test_plugtron_model_exports_as_deepseek_v3(tmp_path):
    """A model made by plugtron (not imported): MLA with q compression, YaRN, dense then MoE
    with sigmoid group-limited routing and expert bias, a shared expert and one MTP depth,
    exports as deepseek_v3; transformers computes the same logits from it, and importing it
    gives back every tensor."""
    from plugtron.core.checkpoint import checkpointer
    from plugtron.core.parallel.distributed import single_process
    from plugtron.core.training.loop import setup
    from plugtron.testing import make_config

    saved, hf_dir, again = (str(tmp_path / n) for n in ("save", "hf", "again"))
    flags = {"num-layers": 3, "hidden-size": 32, "ffn-hidden-size": 48,
             "num-attention-heads": 4, "vocab-size": VOCAB, "normalization": "RMSNorm",
             "norm-epsilon": 1e-6, "swiglu": True, "position-embedding-type": "rope",
             "add-bias-linear": False, "untie-embeddings-and-output-weights": True,
             "multi-latent-attention": True, "q-lora-rank": 12, "kv-lora-rank": 8,
             "qk-head-dim": 6, "qk-pos-emb-head-dim": 4, "v-head-dim": 6,
             "rope-type": "yarn", "rotary-scaling-factor": 40.0, "mscale": 1.0,
             "mscale-all-dim": 1.0, "yarn-original-max-position-embeddings": 16,
             "num-experts": 8, "moe-ffn-hidden-size": 16, "moe-layer-freq": "[0,1,1]",
             "moe-router-topk": 4, "moe-router-score-function": "sigmoid",
             "moe-router-enable-expert-bias": True, "moe-router-num-groups": 4,
             "moe-router-group-topk": 2, "moe-router-topk-scaling-factor": 2.5,
             "moe-shared-expert-intermediate-size": 16, "mtp-num-layers": 1,
             "init-method-std": 0.2, "save": saved, "hidden-dropout": 0.0,
             "attention-dropout": 0.0}
    run = setup(make_config(flags), world=single_process())
    with torch.no_grad():  # norms and expert biases away from their inits
        for name, p in run.model_chunks[0].named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in run.model_chunks[0].named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    checkpointer(run).save(0)
    convert("export-hf", saved, hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "deepseek_v3" and config["first_k_dense_replace"] == 1
    assert config["num_nextn_predict_layers"] == 1
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir).eval()
    batch = tokens(VOCAB, (2, SEQ))
    ours = logits_of(saved, batch, VOCAB)
    with torch.no_grad():
        theirs = model(batch).logits.float()
    assert theirs.std() > 0.1
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    convert("import-hf", hf_dir, again)
    assert_same_checkpoint_tensors(saved, again, VOCAB)

    # --drop mtp: the same model without its MTP layer, as inference engines want it.
    dropped = str(tmp_path / "dropped")
    convert("export-hf", saved, dropped, "--drop", "mtp")
    with open(os.path.join(dropped, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 0
    names = set()
    for path in glob.glob(os.path.join(dropped, "*.safetensors")):
        with safe_open(path, "pt") as f:
            names |= set(f.keys())
    assert names and not any(n.startswith("model.layers.3.") for n in names)
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(dropped).eval()
    with torch.no_grad():
        assert torch.equal(model(batch).logits.float(), theirs)
    refused = convert("export-hf", saved, str(tmp_path / "no"), "--drop", "vision",
                      exit_code=2)
    assert "--drop 'vision'" in refused.output and "mtp (the multi-token" in refused.output


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """One small deepseek_v3 directory with an MTP layer; each refusal edits a copy."""
    path = str(tmp_path_factory.mktemp("ds3") / "hf")
    make_hf({"num_nextn_predict_layers": 1}, 1, path)
    return path


@pytest.mark.parametrize("edit,message", [
    ({"some_new_field": 1}, "some_new_field are unknown"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05"),
    ({"rope_interleave": False}, "rope_interleave=false"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"num_key_value_heads": 128}, "num_key_value_heads 128"),
    ({"topk_group": 1}, "topk_group 1 with num_experts_per_tok 4"),
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config (fp8)"),
    ({"hidden_act": "gelu"}, "hidden_act must be silu"),
    ({"num_nextn_predict_layers": 2}, "hold 1 multi-token prediction layer"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ({"rope_parameters": {**YARN, "mscale": None}}, "mscale_all_dim"),
    ({"first_k_dense_replace": 3}, "but no MoE layer"),
])
def test_what_plugtron_would_compute_differently_exits_2(base_dir, edit, message, tmp_path):
    hf_dir = str(tmp_path / "hf")
    shutil.copytree(base_dir, hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    config.update(edit)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    result = CliRunner().invoke(cli, ["convert", "import-hf", hf_dir, str(tmp_path / "ckpt")])
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert not os.path.exists(tmp_path / "ckpt")


def test_an_mtp_copy_that_differs_from_the_embedding_exits_2(base_dir, tmp_path):
    hf_dir = str(tmp_path / "hf")
    shutil.copytree(base_dir, hf_dir)
    path = os.path.join(hf_dir, "model.safetensors")
    files = load_file(path)
    files["model.layers.3.embed_tokens.weight"] = files["model.layers.3.embed_tokens.weight"] + 1
    save_file(files, path, metadata={"format": "pt"})
    result = CliRunner().invoke(cli, ["convert", "import-hf", hf_dir, str(tmp_path / "ckpt")])
    assert result.exit_code == 2, result.output
    assert "model.layers.3.embed_tokens.weight differs from the model's embedding" \
        in result.output


def test_export_refuses_what_deepseek_v3_cannot_express(tmp_path):
    from plugtron.core.checkpoint import checkpointer
    from plugtron.core.parallel.distributed import single_process
    from plugtron.core.training.loop import setup
    from plugtron.testing import make_config

    saved = str(tmp_path / "save")
    flags = {"num-layers": 2, "normalization": "RMSNorm", "swiglu": True,
             "position-embedding-type": "rope", "add-bias-linear": False,
             "multi-latent-attention": True, "num-experts": 4, "moe-router-topk": 2,
             "moe-shared-expert-intermediate-size": 32, "moe-ffn-hidden-size": 32,
             "moe-router-score-function": "sigmoid", "save": saved}  # --norm-epsilon 1e-5
    run = setup(make_config(flags), world=single_process())
    checkpointer(run).save(0)
    result = CliRunner().invoke(cli, ["convert", "export-hf", saved, str(tmp_path / "hf")])
    assert result.exit_code == 2, result.output
    assert "deepseek_v3 export: --norm-epsilon 1e-05" in result.output


def test_load_hf_dir_trains_deepseek_v3_with_mtp(base_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PLUGTRON_HF_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(cli, [
        "train", "--load", base_dir, "--data", "mock", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
        "--eval-iters", "1", "--no-progress", "--log-interval", "1"])
    assert result.exit_code == 0, result.output
    assert "mtp 1 loss" in result.output, result.output


def test_deepseek_own_rope_scaling_field_imports(base_dir, tmp_path):
    """DeepSeek's own config.json spells YaRN the older way (``rope_scaling`` with ``type``,
    ``rope_theta`` at the top level): it imports to the logits transformers computes from it."""
    hf_dir = str(tmp_path / "hf")
    shutil.copytree(base_dir, hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    config.pop("rope_parameters", None)
    config["rope_theta"] = 10000.0
    config["rope_scaling"] = {"type": "yarn", **{k: v for k, v in YARN.items()
                                                 if k not in ("rope_type", "rope_theta")}}
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir).eval()
    assert model.config.rope_parameters["rope_type"] == "yarn"
    result = convert("import-hf", hf_dir, str(tmp_path / "ckpt"))
    assert "--rope-type yarn --rotary-scaling-factor 40.0" in result.output
    batch = tokens(VOCAB, (2, SEQ))
    ours = logits_of(str(tmp_path / "ckpt"), batch, VOCAB)
    with torch.no_grad():
        theirs = model(batch).logits.float()
        plain = transformers.DeepseekV3ForCausalLM.from_pretrained(base_dir).eval()(batch).logits
    assert (theirs - plain).abs().max() > 1e-3  # YaRN changes this model's function
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
