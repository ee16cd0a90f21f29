"""Against Megatron-Core itself (skipped when megatron-core is not installed): tiny GPTModels
(local spec, CPU, tp 1 in one gloo process or tp 2 in two: megatron_core_worker.py) saved with
``dist_checkpointing.save`` import into plugtron with the same logits within 1e-5 (fp32); plugtron
models exported with ``convert export-megatron`` load with ``dist_checkpointing.load`` into a
Megatron GPTModel with plugtron's logits within 1e-5. Two kinds: Llama-like (RMSNorm, SwiGLU,
GQA, rope, untied, no biases; saved without args, flags on the command line) and GPT-like
(LayerNorm, GeLU, learned positions, biases, tied; saved with args in common.pt)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.checkpoint import checkpointer
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import setup

from gpt_plugin.tests.test_megatron_convert import GPT, LLAMA, SEQ, VOCAB, _logits, _run_for

from .helpers import ckpt_config

pytest.importorskip("megatron.core")

ONE = single_process()
MEGATRON_VOCAB = 128
GPT_ARGS = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
            "ffn_hidden_size": 128, "kv_channels": 8, "seq_length": SEQ,
            "max_position_embeddings": SEQ, "position_embedding_type": "learned_absolute",
            "normalization": "LayerNorm", "norm_epsilon": 1e-5, "swiglu": False,
            "untie_embeddings_and_output_weights": False, "add_bias_linear": True,
            "hidden_dropout": 0.0, "attention_dropout": 0.0, "group_query_attention": False,
            "num_query_groups": 1, "padded_vocab_size": MEGATRON_VOCAB, "vocab_size": None,
            "make_vocab_size_divisible_by": 128, "transformer_impl": "local"}
LLAMA_FLAGS = ["--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "8",
               "--rotary-base", "5000", "--norm-epsilon", "1e-5", "--hidden-dropout", "0",
               "--attention-dropout", "0"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_core_round_trip(tp, tmp_path):
    """At tp 2 Megatron saves each tensor as the chunks of two ranks (the import assembles
    them) and loads plugtron's tp 1 export resharded to tp 2."""
    runner = CliRunner()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    job = {"port": _port(), "seq": SEQ, "tokens": tokens.tolist(), "tp": tp,
           "out": str(tmp_path / "logits.pt"), "kinds": {}}
    expected = {}
    for kind, settings in (("llama", LLAMA), ("gpt", GPT)):
        settings = {**settings, "max_position_embeddings": SEQ} if kind == "gpt" else settings
        run = setup(ckpt_config(save=str(tmp_path / f"plugtron_{kind}"), init_method_std=0.2,
                                kv_channels=8, **settings), world=ONE)
        checkpointer(run).save(0)
        expected[kind] = _logits(run, tokens)
        result = runner.invoke(cli, ["convert", "export-megatron",
                                     str(tmp_path / f"plugtron_{kind}"),
                                     str(tmp_path / f"export_{kind}")])
        assert result.exit_code == 0, result.output
        job["kinds"][kind] = {
            "vocab": MEGATRON_VOCAB, "save": str(tmp_path / f"mcore_{kind}" / "iter_0000003"),
            "args": GPT_ARGS if kind == "gpt" else None,
            "exported": str(tmp_path / f"export_{kind}" / "iter_0000000"),
            "exported_vocab": run.config.model.padded_vocab_size}
    with open(tmp_path / "job.json", "w") as f:
        json.dump(job, f)
    worker = os.path.join(os.path.dirname(__file__), "megatron_core_worker.py")
    ranks = [subprocess.Popen([sys.executable, worker, str(tmp_path / "job.json"), str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(tp)]
    for r, proc in enumerate(ranks):
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"rank {r}: {err[-4000:]}"
    megatron = torch.load(job["out"])
    for kind in ("llama", "gpt"):
        # Megatron -> plugtron: same logits (the saved ones, padded vocabulary included).
        out = str(tmp_path / f"imported_{kind}")
        flags = LLAMA_FLAGS if kind == "llama" else []
        result = runner.invoke(cli, ["convert", "import-megatron", str(tmp_path / f"mcore_{kind}"
                                                                       / "iter_0000003"), out,
                                     *flags])
        assert result.exit_code == 0, result.output
        imported = _run_for(out)
        with torch.no_grad():
            got = imported.model_chunks[0].eval()(tokens).float()
        torch.testing.assert_close(got[..., :MEGATRON_VOCAB],
                                   megatron[f"{kind}_saved"].float(), rtol=0, atol=1e-5)
        # plugtron -> Megatron: the exported checkpoint gives plugtron's logits.
        torch.testing.assert_close(megatron[f"{kind}_exported"][..., :VOCAB].float(),
                                   expected[kind], rtol=0, atol=1e-5)
