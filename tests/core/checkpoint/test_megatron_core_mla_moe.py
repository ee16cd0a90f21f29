"""Against Megatron-Core itself (skipped when megatron-core is not installed): plugtron's
torch_dist export of multi-latent attention (with query compression), MoE (dense layers first,
every layer, every other layer; shared experts, a gated one, sigmoid routing with expert bias
and a scaling factor) and multi-token prediction models. Megatron-Core 0.19 builds its own
GPTModel from the saved ``args`` the way its training script does
(megatron_mla_moe_worker.py): its sharded state dict asks for exactly the exported keys, with
the same global shapes, and the same ``_extra_state`` objects; ``dist_checkpointing.load``
reads the export and the model gives plugtron's logits within 1e-5 (fp32); Megatron then saves
it with ``dist_checkpointing.save`` (its own key names) and ``convert import-megatron`` gives
plugtron's logits back within 1e-5, and each MTP depth's loss (Megatron's training-mode
``mtp_k`` loss, a masked mean) within 1e-5 relative. The vocabulary is 128, which Megatron
does not pad: its cross entropy runs over padded rows, plugtron's over the vocabulary only.

Transformer Engine is not installable here, so Megatron builds its local spec, which names
four norms differently from the TE spec that the export writes (Megatron's TE spec fuses each
into the linear that follows it; read in gpt_layer_specs.py): ``input_layernorm`` /
``self_attention.linear_qkv.layer_norm_weight``, ``pre_mlp_layernorm`` /
``mlp.linear_fc1.layer_norm_weight``, and MLA's ``self_attention.{q,kv}_layernorm`` /
``self_attention.linear_{q,kv}_up_proj.layer_norm_weight``. Both sides are compared with those
pairs read as one name, and the load reads the local spec's keys under the export's names; the
local core attention takes no MLA head sizes, so the worker puts torch's causal attention with
MLA's softmax scale in its place."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.checkpoint import CheckpointReader, load_checkpoint
from plugtron.core.config_flags import apply_values
from plugtron.core.interchange.torch_dist import read_torch_dist
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins.options import config_from_dict
from plugtron.core.training import aux_losses
from plugtron.core.training.loop import setup

from moe_plugin.tests.test_megatron_moe import CASES, MLA, _saved

pytest.importorskip("megatron.core")
if importlib.util.find_spec("megatron.training") is None:  # imported by the worker only
    pytest.skip("megatron.training is not installed", allow_module_level=True)

#: TE-spec name -> local-spec module name (the last part of a key).
_FUSED = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
          "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
          "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
          "self_attention.linear_kv_up_proj.layer_norm_weight":
              "self_attention.kv_layernorm.weight"}
DENSE_MLA_MTP = {"swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False,
                 "position_embedding_type": "rope", "num_layers": 2, "hidden_size": 32,
                 "num_attention_heads": 4, "ffn_hidden_size": 48, **MLA, "q_lora_rank": 12,
                 "mtp_num_layers": 1}


#: A vocabulary Megatron does not pad (128): its cross entropy runs over the padded rows,
#: plugtron's over the vocabulary only, and the MTP losses are compared.
VOCAB = 128


def _imported(path: str):
    """The run of an imported checkpoint, its weights loaded."""
    config = config_from_dict(CheckpointReader(path).config)
    apply_values(config, {"data": "mock", "seq_length": 8, "micro_batch_size": 2,
                          "global_batch_size": 2, "train_iters": 1, "progress": False}, "test")
    config.model.padded_vocab_size = None
    run = setup(config, world=single_process())
    load_checkpoint(run, path, model_only=True)
    return run


def _one_name(key: str) -> str:
    for te, local in _FUSED.items():
        if key.endswith(te):
            return key[:-len(te)] + local
    return key


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Megatron-Core 0.19 cannot compute MLA without query compression as plugtron does (the export
#: refuses it: megatron_convert.refuse_uncompressed_queries), so every MLA case compresses.
MEGATRON_CASES = {"mla-q-dense-then-moe-mtp": CASES["mla-q-dense-then-moe-mtp"],
                  "mla-q-all-moe-mtp-stacked": {**CASES["mla-no-q-all-moe-mtp"],
                                                "q_lora_rank": 12},
                  "gqa-moe-freq-2": CASES["gqa-moe-freq-2"],
                  "mla-dense-mtp": DENSE_MLA_MTP,
                  "mla-yarn": {**DENSE_MLA_MTP, "mtp_num_layers": None, "rope_type": "yarn",
                               "rotary_scaling_factor": 4.0, "mscale": 0.707,
                               "mscale_all_dim": 0.707}}


@pytest.mark.parametrize("case", list(MEGATRON_CASES))
def test_megatron_core_builds_the_exported_model(case, tmp_path):
    settings = MEGATRON_CASES[case]
    run = _saved(settings, str(tmp_path / "save"), vocab=VOCAB)
    result = CliRunner().invoke(cli, ["convert", "export-megatron", str(tmp_path / "save"),
                                      str(tmp_path / "mcore")])
    assert result.exit_code == 0, result.output
    exported = read_torch_dist(str(tmp_path / "mcore"))
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    job = {"port": _port(), "exported": exported.directory, "out": str(tmp_path / "keys.json"),
           "tokens": tokens.tolist(), "fused": _FUSED, "exported_keys": list(exported.tensors),
           "save": str(tmp_path / "megatron_saved" / "iter_0000001"),
           "labels": torch.roll(tokens, -1, 1).tolist()}
    with open(tmp_path / "job.json", "w") as f:
        json.dump(job, f)
    worker = os.path.join(os.path.dirname(__file__), "megatron_mla_moe_worker.py")
    proc = subprocess.run([sys.executable, worker, str(tmp_path / "job.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(job["out"]) as f:
        megatron = json.load(f)
    assert megatron["num_moe_experts"] == settings.get("num_experts")
    assert megatron["q_lora_rank"] == settings.get("q_lora_rank")
    if settings.get("multi_latent_attention"):
        # said explicitly: Megatron's MLA default is yarn
        assert megatron["rope_type"] == settings.get("rope_type", "rope")
    ours = {_one_name(k): list(info.shape) for k, info in exported.tensors.items()}
    theirs = {_one_name(k): shape for k, shape in megatron["tensors"].items()}
    assert len(theirs) == len(megatron["tensors"]) > 10  # the renaming merges no two keys
    assert sorted(set(theirs) - set(ours)) == [] and sorted(set(ours) - set(theirs)) == []
    assert {k: v for k, v in ours.items() if theirs[k] != v} == {}
    with torch.no_grad():
        ours_logits = run.model_chunks[0].eval()(tokens).float()
    torch.testing.assert_close(torch.tensor(megatron["logits"])[..., :VOCAB],
                               ours_logits[..., :VOCAB], rtol=0, atol=1e-5)
    # Megatron's own save (local spec names) imports into the same model
    result = CliRunner().invoke(cli, ["convert", "import-megatron", job["save"],
                                      str(tmp_path / "imported")])
    assert result.exit_code == 0, result.output
    imported = _imported(str(tmp_path / "imported"))
    with torch.no_grad():
        got = imported.model_chunks[0].eval()(tokens).float()
    torch.testing.assert_close(got[..., :VOCAB], ours_logits[..., :VOCAB], rtol=0, atol=1e-5)
    if settings.get("mtp_num_layers"):  # each depth's masked mean loss
        labels, mask = torch.tensor(job["labels"]), torch.ones(tokens.shape)
        aux_losses.note_microbatch({"loss_mask": mask})
        aux_losses.take()
        with torch.no_grad():
            imported.model_chunks[0](tokens, labels=labels, loss_mask=mask)
        reported = aux_losses.take()
        depths = [float(reported[f"mtp_{k + 1} loss"]) / mask.sum().item()
                  for k in range(settings["mtp_num_layers"])]
        torch.testing.assert_close(torch.tensor(depths), torch.tensor(megatron["mtp_losses"]),
                                   rtol=1e-5, atol=0)
    assert set(megatron["objects"]) == set(exported.objects) - {
        k for k in exported.objects if k.startswith("common_state")}
