"""Megatron-Core torch_dist checkpoints saved by a tp 2, a pp 2 and a tp 2 x pp 2 job (each rank
writing its own chunks with torch.distributed.checkpoint, as dist_checkpointing does:
megatron_sharded_fixtures.py) import into one plugtron model whose logits equal the tp 1 source
model's within 1e-5 (fp32). The tp 2 x pp 2 case also carries the attention options in Megatron's
saved form (qk_layernorm, add_qkv_bias, window_size as a tuple, use_rope_scaling). One pool of 4
gloo ranks for the module."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.checkpoint import CheckpointReader
from plugtron.core.errors import CheckpointError
from plugtron.core.interchange.torch_dist import read_torch_dist

from gpt_plugin.tests.test_megatron_convert import (
    GPT,
    LLAMA,
    SEQ,
    VOCAB,
    _args,
    _logits,
    _megatron_names,
    _run_for,
    _source,
)

from .megatron_sharded_fixtures import global_plan, save_sharded, write_common

QWEN3 = {**LLAMA, "qk_layernorm": True, "add_qkv_bias": True, "window_size": "5,0",
         "use_rope_scaling": True, "rope_scaling_factor": 4.0}
QWEN3_ARGS = {"qk_layernorm": True, "add_qkv_bias": True, "window_size": (5, 0),
              "use_rope_scaling": True, "rope_scaling_factor": 4.0}
CASES = {  # name: (model settings, tp, pp, plan options, extra saved args)
    "llama-tp2-te-stacked": (LLAMA, 2, 1, {"spec": "te"}, {}),
    "gpt-pp2-per-layer-tied": (GPT, 1, 2, {"stacked": False}, {}),
    "qwen3-tp2-pp2-stacked": (QWEN3, 2, 2, {}, QWEN3_ARGS),
}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(4)


def _padded(params: dict, rows: int) -> dict:
    """Megatron's padded vocabulary (random rows past the real ones, as its init leaves)."""
    out = dict(params)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in out:
            extra = torch.randn(rows - out[name].shape[0], out[name].shape[1],
                                generator=torch.Generator().manual_seed(5))
            out[name] = torch.cat([out[name], extra])
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_megatron_checkpoint_gives_the_tp1_logits(case, pool, tmp_path):
    settings, tp, pp, options, extra = CASES[case]
    run, params = _source(settings)
    m = run.config.model
    padded = 128 * tp  # Megatron pads to make_vocab_size_divisible_by (128) x tp
    plan = global_plan(_padded(params, padded), m.num_layers, tp, pp,
                       swiglu=bool(m.swiglu), tied=not m.untie_embeddings_and_output_weights,
                       **options)
    args = _args(settings, padded_vocab_size=padded, tensor_model_parallel_size=tp,
                 pipeline_model_parallel_size=pp, **extra)
    with _megatron_names():
        directory = write_common(str(tmp_path / "mcore"), 9, args)
    pool.run(save_sharded, plan, directory, world_size=tp * pp)
    # The files hold what a tp x pp job writes: one shard file per rank, tensors in chunks.
    ckpt = read_torch_dist(directory)
    qkv = ckpt.tensors[next(k for k in ckpt.tensors if k.endswith("linear_qkv.weight"))]
    assert len(qkv.chunks) == tp * (m.num_layers if options.get("stacked", True) else 1)
    assert len({c[2].field("relative_path") for i in ckpt.tensors.values()
                for c in i.chunks}) == tp * pp
    out = str(tmp_path / "imported")
    result = CliRunner().invoke(cli, ["convert", "import-megatron", str(tmp_path / "mcore"), out])
    assert result.exit_code == 0, result.output
    saved = CheckpointReader(out).config
    for name, value in settings.items():
        section = next(s for s in saved.values() if name in s)
        assert section[name] == value, name
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(_run_for(out), tokens), _logits(run, tokens), rtol=0,
                               atol=1e-5)
    if case.startswith("llama-tp2"):  # two chunks claiming the same rows are refused
        key = "decoder.layers.self_attention.linear_qkv.weight"
        chunks = ckpt.tensors[key].chunks
        chunks[1] = (chunks[0][0], *chunks[1][1:])
        with pytest.raises(CheckpointError, match="overlap"):
            ckpt.read(key)
