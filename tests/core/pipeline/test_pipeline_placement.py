"""The placement of virtual stages (looped, or the V of zbv/dualpipev), without processes: the
layers each chunk holds, which chunk is first and last, the embedding group, the point-to-point
plan, and the checks before launch."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from plugtron.api import LOOPED, V_SHAPE, chunk_layers, stage_owner, virtual_stage
from plugtron.cli.main import cli
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.context import ParallelContext, rank_groups
from plugtron.core.pipeline.executor import communication_plan
from plugtron.core.training.validate import validate

from tests.plugins.schedules.test_pipeline_schedules import tiny_config


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_virtual_stage_and_owner_are_inverse(pp):
    for placement in (LOOPED, V_SHAPE):
        seen = set()
        for rank in range(pp):
            for chunk in range(2):
                stage = virtual_stage(rank, chunk, pp, placement)
                assert stage_owner(stage, pp, placement) == (rank, chunk)
                seen.add(stage)
        assert seen == set(range(2 * pp))


def test_v_shape_layers_go_down_the_ranks_and_back_up():
    layers = {(r, c): list(chunk_layers(16, 4, r, 2, c, placement=V_SHAPE))
              for r in range(4) for c in range(2)}
    assert layers[(0, 0)] == [0, 1] and layers[(0, 1)] == [14, 15]
    assert layers[(3, 0)] == [6, 7] and layers[(3, 1)] == [8, 9]
    assert layers[(1, 1)] == [12, 13]
    # looped is unchanged: chunk 1 of rank 0 is stage 4
    assert list(chunk_layers(16, 4, 0, 2, 1)) == [8, 9]


def test_v_shape_refuses_uneven_first_and_last_stages_and_other_chunk_counts():
    with pytest.raises(ConfigError, match="rank 0 holds both the first and the last"):
        chunk_layers(12, 2, 0, 2, 0, first=4, placement=V_SHAPE)
    with pytest.raises(ConfigError, match="exactly two model chunks"):
        chunk_layers(12, 2, 0, 3, 0, placement=V_SHAPE)


def test_first_and_last_stage_under_a_v():
    first = ParallelContext.build(4, 0, pp=4, vp=2, placement=V_SHAPE)
    last_rank = ParallelContext.build(4, 3, pp=4, vp=2, placement=V_SHAPE)
    assert first.is_pipeline_first_stage(0) and first.is_pipeline_last_stage(1)
    assert first.is_pipeline_first_stage() and first.is_pipeline_last_stage()
    assert not last_rank.is_pipeline_last_stage() and not last_rank.is_pipeline_last_stage(1)
    assert last_rank.virtual_stage(0) == 3 and last_rank.virtual_stage(1) == 4
    looped = ParallelContext.build(4, 3, pp=4, vp=2)
    assert looped.is_pipeline_last_stage(1) and not looped.is_pipeline_last_stage(0)
    # the tied embedding's two copies share rank 0: an embedding group of one per pipeline
    assert rank_groups(8, pp=4, placement=V_SHAPE)["embedding"] == [[0], [1]]
    assert rank_groups(8, pp=4)["embedding"] == [[0, 6], [1, 7]]
    with pytest.raises(ConfigError, match="exactly two model chunks"):
        ParallelContext.build(4, 0, pp=4, vp=3, placement=V_SHAPE)


def test_the_v_plan_hands_over_locally_at_the_tip_and_sends_the_way_back_up():
    from plugtron.plugins.schedules.zbv import zbv_actions

    per_rank = tuple(tuple(zbv_actions(r, 3, 6)) for r in range(3))
    plan = communication_plan(per_rank, 2, V_SHAPE)
    sends = {}
    for rank, steps in enumerate(plan):
        for step in steps:
            if step.action is not None:
                sends[(rank, str(step.action))] = (step.send_next, step.send_prev)
    assert sends[(2, "F0")] == (False, False)  # stage 2 -> stage 3 on the same rank
    assert sends[(2, "I0.c1")] == (False, False)  # stage 3 -> stage 2: local too
    assert sends[(2, "F0.c1")] == (False, True)  # stage 3 -> stage 4 on rank 1
    assert sends[(1, "F0.c1")] == (False, True)  # stage 4 -> stage 5 on rank 0
    assert sends[(0, "F0.c1")] == (False, False)  # the last stage: the loss
    assert sends[(0, "I0.c1")] == (True, False)  # stage 5's input gradient back to rank 1
    assert sends[(0, "I0")] == (False, False)  # stage 0: nothing before it
    # every message is received exactly once, under its key
    received = [key for steps in plan for step in steps
                for key in (step.recv_prev, step.recv_next) if key is not None]
    assert len(received) == len(set(received)) == 6 * (2 * (3 - 1) + 2 * (3 - 1))


def test_zbv_gets_two_chunks_without_vp_and_refuses_another_count():
    config = tiny_config(num_layers=4, pp=2, schedule="zbv")
    validate(config, 2)
    assert config.parallel.pipeline_placement == V_SHAPE
    assert config.parallel.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ConfigError, match="exactly two model chunks"):
        validate(tiny_config(num_layers=6, pp=2, vp=3, schedule="zbv"), 2)


def test_cli_refuses_bad_v_layouts_with_exit_2():
    runner = CliRunner()
    out = runner.invoke(cli, ["train", "--data", "mock", "--vocab-size", "64", "--num-layers",
                              "6", "--pp", "2", "--schedule", "zbv", "--nproc-per-node", "2"])
    assert out.exit_code == 2 and "not divisible by --pp 2 x --vp 2" in out.output
    out = runner.invoke(cli, ["train", "--data", "mock", "--vocab-size", "64", "--num-layers",
                              "8", "--pp", "2", "--schedule", "zbv",
                              "--decoder-first-pipeline-num-layers", "2",
                              "--nproc-per-node", "2"])
    assert out.exit_code == 2 and "rank 0 holds both" in out.output
    out = runner.invoke(cli, ["train", "--data", "mock", "--vocab-size", "64", "--num-layers",
                              "8", "--pp", "2", "--micro-batch-size", "1", "--global-batch-size", "2", "--schedule",
                              "dualpipev", "--nproc-per-node", "2"])
    assert out.exit_code == 2 and "at least as many microbatches as stages" in out.output


def test_topology_and_schedule_show_print_the_placement():
    runner = CliRunner()
    out = runner.invoke(cli, ["topology", "--world-size", "4", "--pp", "4", "--schedule", "zbv"])
    assert out.exit_code == 0, out.output
    assert "pipeline placement v: pp rank 0 holds stages 0, 7;" in out.output
    assert "embedding: [0]\n" in out.output  # one pipeline; both copies on its rank 0
    report = json.loads(runner.invoke(cli, ["topology", "--world-size", "4", "--pp", "4",
                                            "--schedule", "zbv", "--json"]).output)
    assert report["stages_of_pp_rank"]["3"] == [3, 4] and report["sizes"]["vp"] == 2
    show = runner.invoke(cli, ["schedule", "show", "--schedule", "zbv", "--pp", "4",
                               "--microbatches", "8"])
    assert show.exit_code == 0, show.output
    assert "schedule zbv: pp 4, vp 2 (v-shape placement), 8 microbatches" in show.output
    assert "bubble fraction per rank: 0.0588 0.0588 0.0588 0.0588" in show.output
    assert "peak stored activations (microbatch-chunks) per rank: 8 8 8 8" in show.output


@pytest.mark.parametrize("name, vp, makespan, idle, peaks", [
    ("1f1b", None, 33, [9, 6, 3, 0], [4, 3, 2, 1]),
    ("interleaved-1f1b", 2, 57, [9, 6, 3, 0], [11, 9, 7, 5]),
    ("zb-h1", None, 27, [3, 2, 1, 0], [4, 4, 4, 4]),
    ("zb-h2", None, 27, [0, 0, 0, 0], [7, 7, 7, 7]),
    ("interleaved-zero-bubble", 2, 51, [3, 2, 1, 0], [8, 8, 8, 8]),
    ("zbv", None, 51, [0, 0, 0, 0], [8, 8, 8, 8]),
    ("dualpipev", None, 51, [3, 2, 1, 0], [9, 9, 9, 9]),
])
def test_the_bubble_table_of_the_docs(name, vp, makespan, idle, peaks):
    from plugtron.cli.schedule_cmd import describe_schedule

    report, _ = describe_schedule(name, 4, vp, 8)
    assert report["makespan"] == makespan
    assert [r["idle_in_span"] for r in report["ranks"]] == idle
    assert [r["peak_stored_activations"] for r in report["ranks"]] == peaks


def test_hook_pipeline_placement():
    # the optional schedule hook, through a run's plugin manager: absent means looped; "v"
    # gives two chunks per rank; anything else is refused with what is allowed
    from plugtron.core.plugins.manager import new_plugin_manager
    from plugtron.core.training.validate import apply_schedule_placement

    from tests.schedule_helpers import VShapeGPipe

    class Diagonal:
        @staticmethod
        def pipeline_placement(pp_size):
            return "diagonal"

    for plugin, want in ((None, LOOPED), (VShapeGPipe(), V_SHAPE)):
        pm = new_plugin_manager()
        if plugin is not None:
            pm.register(plugin)
        config = tiny_config(num_layers=4, pp=2)
        assert apply_schedule_placement(config, pm.hook) == want
        assert config.parallel.pipeline_placement == want
        assert config.parallel.virtual_pipeline_model_parallel_size == (2 if want == V_SHAPE
                                                                         else None)
    with pytest.raises(ConfigError, match="'diagonal' is not one of looped, v"):
        apply_schedule_placement(tiny_config(num_layers=4, pp=2), Diagonal())
