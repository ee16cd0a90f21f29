"""Training under context parallelism equals one process (fp32, dropout 0, relative 1e-5 on
every iteration's lm loss and grad norm), through the conformance kit's layout check.

cp 2 and cp 4 with each comm type (learned positions and RoPE, MHA and GQA); and cp composed with
tp + sequence parallelism, pp, dp with the distributed optimizer, and tp x cp x pp on 8 ranks;
the Hybrid model's attention and MLP layers under cp.
"""

import math

import pytest
import torch
from plugtron.testing import assert_layouts_match

COMM_TYPES = ("p2p", "allgather", "a2a")
GPT = {"model": "gpt"}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(8, timeout=300)


def _cp_layouts(*sizes):
    return [{"cp": cp, "cp-comm-type": c} for cp in sizes for c in COMM_TYPES]


@pytest.mark.parametrize("positions", ["learned_absolute", "rope"])
def test_cp2_and_cp4_each_comm_type(pool, positions):
    assert_layouts_match({**GPT, "position-embedding-type": positions},
                         layouts=_cp_layouts(2, 4), pool=pool)


def test_grouped_query_attention_under_cp(pool):
    assert_layouts_match({**GPT, "num-query-groups": 2, "position-embedding-type": "rope"},
                         layouts=_cp_layouts(2), pool=pool)


def test_cp_composes_with_tp_sp_pp_dp(pool):
    layouts = [
        {"tp": 2, "cp": 2, "sequence-parallel": True},
        {"tp": 2, "cp": 2, "sequence-parallel": True, "cp-comm-type": "a2a"},
        {"cp": 2, "pp": 2},
        {"cp": 2, "dp": 2, "use-distributed-optimizer": True},
        {"tp": 2, "cp": 2, "pp": 2},
        {"tp": 2, "cp": 2, "pp": 2, "sequence-parallel": True, "cp-comm-type": "allgather"},
    ]
    assert_layouts_match({**GPT, "position-embedding-type": "rope"}, layouts=layouts, pool=pool)


def test_packed_records_cut_in_parts_at_cp4_and_composed(pool, tmp_path):
    """Packed instruction records (--data sft), each padded to a multiple of 2 x 4 so that cp
    cuts every record in 8 parts: cp 4 over each comm type, and cp 2 with tp 2 + sp, equal one
    process (the records of one file, 2 to 3 a sequence)."""
    import json

    path = tmp_path / "records.jsonl"
    gen = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for n in (5, 9, 14, 3, 11, 7, 6, 12):
            ids = torch.randint(0, 120, (n + 3,), generator=gen).tolist()
            f.write(json.dumps({"prompt": " ".join(map(str, ids[:n])),
                                "response": " ".join(map(str, ids[n:]))}) + "\n")
    flags = {**GPT, "position-embedding-type": "rope", "data": "sft", "data-path": str(path),
             "tokenizer-type": "NullTokenizer", "vocab-size": 128, "seq-length": 48,
             "split": "100,0,0", "sft-pad-to-multiple-of": 8, "global-batch-size": 4}
    assert_layouts_match(flags, layouts=[*_cp_layouts(4), {"tp": 2, "cp": 2,
                                                          "sequence-parallel": True}],
                         pool=pool)


def test_hybrid_attention_and_mlp_layers_under_cp(pool):
    assert_layouts_match({"model": "hybrid", "hybrid-layer-pattern": "*-*-", "num-layers": 4,
                          "position-embedding-type": "rope"},
                         layouts=[{"cp": 2}, {"cp": 2, "cp-comm-type": "a2a"}], pool=pool)


FP16 = {"fp16": True, "initial_loss_scale": 256.0, "hysteresis": 1, "train_iters": 4,
        "cp": 2}


def test_fp16_overflow_on_one_cp_rank_skips_the_step_on_both(pool):
    """found-inf reaches every cp rank: an inf gradient on cp rank 1 only (iteration 3) skips
    that step on both ranks, halves the loss scale on both and leaves them equal."""
    from tests.distributed.dp_helpers import max_param_diff, pool_train

    results = pool.run(pool_train, FP16, inject=(3, None, 1), world_size=2)
    for result in results:
        assert result["skipped"] == [False, False, True, False]
        assert result["loss_scale"] == [256.0, 256.0, 128.0, 128.0]
        assert all(math.isfinite(x) for x in result["losses"])
    assert max_param_diff(results[0]["params"], results[1]["params"]) == 0.0
