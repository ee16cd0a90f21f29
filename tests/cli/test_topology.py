"""Rank layout (Megatron-Core's tp-cp-ep-dp-pp order) and the size checks, without processes."""

import json

import pytest
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.context import ParallelContext, rank_groups, validate_sizes


def test_tp2_pp2_dp2():
    g = rank_groups(8, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp-cp"] == g["dp"]
    assert g["cp"] == [[r] for r in range(8)]
    assert g["model-parallel"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["embedding"] == g["pp"]
    # Expert grid defaults to etp = tp, ep = 1: the same layout as the decoder's.
    assert g["etp"] == g["tp"] and g["edp"] == g["dp"] and g["ep"] == g["cp"]


def test_tp2_cp2_dp2():
    g = rank_groups(8, tp=2, cp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["tp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["pp"] == [[r] for r in range(8)]
    assert g["embedding"] == [[r] for r in range(8)]
    assert g["model-parallel"] == g["tp"]


def test_expert_grid_tp2_ep2_etp1():
    g = rank_groups(8, tp=2, ep=2, etp=1)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["etp"] == [[r] for r in range(8)]
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["edp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_expert_grid_with_pp_shares_pipeline_groups():
    g = rank_groups(8, tp=1, pp=2, ep=2, etp=2)
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["etp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["edp"] == [[r] for r in range(8)]


def test_pp4_embedding_is_first_and_last_stage():
    g = rank_groups(8, tp=2, pp=4)
    assert g["pp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["embedding"] == [[0, 6], [1, 7]]
    assert g["dp"] == [[0], [1], [2], [3], [4], [5], [6], [7]]


@pytest.mark.parametrize("layout", [{"tp": 2, "pp": 2}, {"tp": 2, "cp": 2}, {"pp": 4, "ep": 2},
                                    {"tp": 4, "ep": 2, "etp": 1},
                                    {"cp": 2, "pp": 2, "ep": 4, "etp": 1}])
def test_every_kind_partitions_the_world(layout):
    for kind, groups in rank_groups(8, **layout).items():
        flat = sorted(r for grp in groups for r in grp)
        if kind == "embedding":
            assert len(set(flat)) == len(flat)
        else:
            assert flat == list(range(8)), kind


@pytest.mark.parametrize("args, message", [
    ({"world_size": 6, "tp": 4}, "world size 6 is not divisible by tp 4 x pp 1 x cp 1 = 4"),
    ({"world_size": 8, "tp": 2, "pp": 2, "cp": 4}, "tp 2 x pp 2 x cp 4 = 16"),
    ({"world_size": 8, "ep": 3}, "world size 8 is not divisible by etp 1 x ep 3 x pp 1 = 3"),
    ({"world_size": 8, "tp": 2, "ep": 8}, "etp 2 x ep 8 x pp 1 = 16"),
    ({"world_size": 8, "vp": 2}, "--vp needs --pp > 1"),
    ({"world_size": 8, "pp": 2, "vp": 0}, "--vp must be an integer >= 1, got 0"),
    ({"world_size": 8, "tp": 0}, "--tp must be an integer >= 1, got 0"),
    ({"world_size": 0}, "world size must be an integer >= 1, got 0"),
])
def test_validate_sizes_errors(args, message):
    with pytest.raises(ConfigError) as err:
        validate_sizes(**args)
    assert message in str(err.value)


def test_validate_sizes_accepts_good_layouts():
    validate_sizes(8, tp=2, pp=2, cp=1, ep=1, etp=None, vp=2)
    validate_sizes(8, tp=4, pp=1, cp=2, ep=8, etp=1)


def test_single_process_context():
    ctx = ParallelContext.build(1, 0)
    assert (ctx.tp_size, ctx.pp_size, ctx.dp_size, ctx.edp_size) == (1, 1, 1, 1)
    assert ctx.tp_group is None and ctx.dp_group is None and ctx.embedding_group is None
    assert ctx.is_pipeline_first_stage() and ctx.is_pipeline_last_stage()
    assert ctx.pp_prev_rank == ctx.pp_next_rank == 0 and ctx.in_embedding_group


def test_context_without_processes_knows_its_place():
    """The CLI can describe any rank's layout without launching anything."""
    ctx = ParallelContext.build(8, 5, tp=2, pp=2, vp=2)
    assert (ctx.tp_rank, ctx.dp_rank, ctx.pp_rank) == (1, 0, 1)
    assert ctx.tp_ranks == [4, 5] and ctx.pp_ranks == [1, 5] and ctx.dp_ranks == [5, 7]
    assert ctx.pp_prev_rank == ctx.pp_next_rank == 1
    assert ctx.is_pipeline_last_stage() and not ctx.is_pipeline_last_stage(vp_rank=0)
    assert ctx.is_pipeline_last_stage(vp_rank=1) and not ctx.is_pipeline_first_stage()
    described = ctx.describe()
    assert described["sizes"]["dp"] == 2 and described["groups"] == rank_groups(8, tp=2, pp=2)
    json.dumps(described)
    with pytest.raises(ConfigError, match="--vp needs --pp > 1"):
        ParallelContext.build(8, 0, tp=2, vp=2)
