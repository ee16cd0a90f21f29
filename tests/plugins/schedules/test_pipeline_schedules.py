"""Pipeline schedules as data: action lists, their checks, the simulated timeline, the
``schedule show`` command and the stage layout. No processes are started."""

import contextlib
import json
import struct
import zlib

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.errors import ConfigError
from plugtron.core.pipeline.executor import communication_plan, plan_for
from plugtron.core.pipeline.layout import chunk_layers
from plugtron.core.pipeline.plan import (
    Action,
    bubble_fraction,
    check_actions,
    peak_stored,
    simulate,
)
from plugtron.core.training.validate import validate
from plugtron.plugins.schedules.gpipe import GPipe
from plugtron.plugins.schedules.interleaved import interleaved_actions
from plugtron.plugins.schedules.one_f_one_b import one_f_one_b_actions

from tests.schedule_helpers import random_valid_orders
from tests.utils import tiny_config


def names(actions):
    return " ".join(str(a) for a in actions)


def test_1f1b_warmup_steady_cooldown():
    assert names(one_f_one_b_actions(0, 4, 6)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert names(one_f_one_b_actions(3, 4, 6)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert names(one_f_one_b_actions(0, 4, 2)) == "F0 F1 B0 B1"  # warmup capped at M


def test_interleaved_follows_megatrons_table():
    # pp 2, vp 2, M 4, group 2; rank 0 warms up with (2-0-1)*2 + (2-1)*2 = 4 forwards.
    assert names(interleaved_actions(0, 2, 2, 4, 2)) == (
        "F0 F1 F0.c1 F1.c1 F2 B0.c1 F3 B1.c1 F2.c1 B0 F3.c1 B1 B2.c1 B3.c1 B2 B3")
    assert names(interleaved_actions(1, 2, 2, 4, 2)) == (
        "F0 F1 F0.c1 B0.c1 F1.c1 B1.c1 F2 B0 F3 B1 F2.c1 B2.c1 F3.c1 B3.c1 B2 B3")
    # A group of 3 with M 8 leaves a last group of 2 (>= pp): the table still covers everything.
    per_rank = [interleaved_actions(r, 2, 2, 8, 3) for r in range(2)]
    check_actions(per_rank, 2, 8)
    simulate(per_rank, 2)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4), (4, 2)])
def test_1f1b_and_gpipe_bubble_and_memory(pp, m):
    ofob = [one_f_one_b_actions(r, pp, m) for r in range(pp)]
    gpipe = [GPipe().schedule_actions(1, m) for _ in range(pp)]
    ideal = (pp - 1) / (m + pp - 1)
    assert bubble_fraction(simulate(ofob, 1)) == pytest.approx(ideal)
    assert bubble_fraction(simulate(gpipe, 1)) == pytest.approx(ideal)
    assert [peak_stored(a) for a in ofob] == [min(pp - r, m) for r in range(pp)]
    assert [peak_stored(a) for a in gpipe] == [m] * pp


@pytest.mark.parametrize("pp,vp,m", [(2, 2, 4), (4, 2, 8), (4, 3, 12)])
def test_interleaving_shrinks_the_bubble(pp, vp, m):
    per_rank = [interleaved_actions(r, pp, vp, m, pp) for r in range(pp)]
    assert bubble_fraction(simulate(per_rank, vp)) == pytest.approx((pp - 1) / (vp * m + pp - 1))


def test_bad_action_lists_are_named():
    f, b = (lambda mb, c=0: Action("F", mb, c)), (lambda mb, c=0: Action("B", mb, c))
    with pytest.raises(ConfigError, match="B0 runs before its forward"):
        check_actions([[b(0), f(0)]], 1, 1)
    with pytest.raises(ConfigError, match="exactly once"):
        check_actions([[f(0), f(1), b(0)]], 1, 2)
    with pytest.raises(ConfigError, match="microbatches in order"):
        check_actions([[f(1), f(0), b(0), b(1)]], 1, 2)
    # Rank 0 waits for B0 of rank 1 before F1; rank 1 runs B1 (which needs F1) before B0.
    cyclic = [[f(0), b(0), f(1), b(1)], [f(0), f(1), b(1), b(0)]]
    check_actions(cyclic, 1, 2)
    with pytest.raises(ConfigError, match="wait on each other forever: rank 0 at B0 needs B0"):
        plan_for(cyclic, 1, 2, forward_only=False)


@pytest.mark.parametrize("seed", range(5))
def test_any_valid_order_gets_a_paired_plan(seed):
    per_rank = random_valid_orders(4, 2, 4, seed)
    plan = communication_plan(tuple(map(tuple, per_rank)), 2)
    # Each send is received by the neighbour in the batch of the same step.
    for rank, steps in enumerate(plan):
        assert [s.action for s in steps if s.action] == per_rank[rank]
        for step in steps:
            if step.send_next:
                peer = {s.tick: s for s in plan[(rank + 1) % 4]}[step.tick]
                assert peer.recv_prev == ("F", step.action.microbatch,
                                          step.action.chunk * 4 + rank + 1)
            if step.send_prev:
                peer = {s.tick: s for s in plan[(rank - 1) % 4]}[step.tick]
                assert peer.recv_next == ("B", step.action.microbatch,
                                          step.action.chunk * 4 + rank - 1)


def test_uneven_stages_with_interleaving():
    layers = [[list(chunk_layers(16, 4, p, 2, v, 2, 6)) for v in range(2)] for p in range(4)]
    assert layers == [[[0], [8]], [[1, 2], [9, 10]], [[3, 4], [11, 12]],
                      [[5, 6, 7], [13, 14, 15]]]
    assert sorted(i for rank in layers for chunk in rank for i in chunk) == list(range(16))
    with pytest.raises(ConfigError, match="divisible by --vp"):
        chunk_layers(8, 2, 0, 2, 0, 3, None)


@pytest.mark.parametrize("overrides,message", [
    ({"num_layers": 6, "pp": 2, "vp": 2}, "--num-layers 6 is not divisible by --pp 2 x --vp 2"),
    ({"num_layers": 8, "pp": 4, "vp": 2, "global_batch_size": 4, "micro_batch_size": 2},
     "pp 4 <= microbatch group size 4 .* <= microbatches per step 2"),
    ({"num_layers": 8, "pp": 2, "vp": 2, "global_batch_size": 10, "micro_batch_size": 1,
      "microbatch_group_size_per_vp_stage": 3}, "last group of 1"),
    ({"vp": 2}, "--vp needs --pp > 1"),
    ({"num_layers": 8, "pp": 2, "vp": 2, "schedule": "1f1b"}, "use --schedule interleaved-1f1b"),
    ({"pp": 2, "schedule": "no-pipelining"}, "runs one pipeline stage"),
])
def test_bad_combinations_fail_before_launch(overrides, message):
    world = overrides.get("pp", 1)
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**overrides), world)


def test_train_cli_reports_bad_layout_without_launching():
    result = CliRunner().invoke(cli, ["train", "--data", "mock", "--vocab-size", "64",
                                      "--num-layers", "6", "--pp", "2", "--vp", "2",
                                      "--nproc-per-node", "4"])
    assert result.exit_code == 2
    assert "not divisible by --pp 2 x --vp 2" in result.output


def test_schedule_show_text_json_and_plot(tmp_path):
    runner = CliRunner()
    text = runner.invoke(cli, ["schedule", "show", "--pp", "2", "--microbatches", "4"])
    assert text.exit_code == 0, text.output
    assert "schedule 1f1b: pp 2, 4 microbatches" in text.output  # auto picks 1f1b
    assert "rank 0: F0 F1 B0 F2 B1 F3 B2 B3" in text.output
    assert "bubble fraction 0.2000" in text.output
    png = tmp_path / "t.png"
    out = runner.invoke(cli, ["schedule", "show", "--pp", "4", "--vp", "2", "-m", "8", "--json",
                              "--plot", str(png)])
    report = json.loads(out.output)
    assert report["schedule"] == "interleaved-1f1b"
    assert [r["peak_stored_activations"] for r in report["ranks"]] == [11, 9, 7, 5]
    assert report["ranks"][3]["actions"][:2] == [{"kind": "F", "microbatch": 0, "chunk": 0},
                                                 {"kind": "F", "microbatch": 1, "chunk": 0}]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    idat_len = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41:41 + idat_len])
    assert len(raw) == height * (1 + 3 * width) and height == 4 * 26 + 4
    bad = runner.invoke(cli, ["schedule", "show", "--pp", "4", "--vp", "2", "-m", "3"])
    assert bad.exit_code == 2 and "microbatches per step 3" in bad.output
    unknown = runner.invoke(cli, ["schedule", "show", "--schedule", "zb", "--pp", "2", "-m", "4"])
    assert unknown.exit_code == 2 and "available:" in unknown.output


def test_custom_schedule_example_in_the_docs_is_valid():
    import pathlib
    import re

    doc = pathlib.Path(__file__).parents[3] / "docs" / "pipeline_schedules.md"
    code = re.search(r"```python\n(.*?)```", doc.read_text(), re.DOTALL).group(1)
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - our own docs
    schedule = namespace["EagerOneFOneB"]()
    for pp, m in [(2, 4), (4, 8), (4, 2)]:
        per_rank = [schedule.schedule_actions(r, pp, m) for r in range(pp)]
        check_actions(per_rank, 1, m)
        plan_for(per_rank, 1, m, forward_only=False)
        assert peak_stored(per_rank[0]) == min(pp + 1, m)


class _Chunk(torch.nn.Module):
    """A one-stage model chunk that records when grad sync is suppressed."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(2.0))
        self.synced = []  # per backward: was grad sync enabled?
        self._sync = True

    def set_input_tensor(self, tensor):
        raise AssertionError("a single stage takes no input tensor")

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def forward(self, x):
        out = self.weight * x
        if out.requires_grad:
            out.register_hook(lambda g: self.synced.append(self._sync))
        return out


def _forward_step(data_iterator, model):
    x = next(data_iterator)
    out = model(x)

    def loss(output):
        return output.sum(), torch.tensor(float(output.numel())), {"lm loss": output.detach()}
    return out, loss


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_executor_on_one_stage(schedule):
    from plugtron.core.parallel.context import ParallelContext
    from plugtron.core.pipeline import executor as pipeline_executor

    parallel = ParallelContext.build(1, 0)
    chunk = _Chunk()
    data = [torch.tensor([1.0, 2.0]), torch.tensor([3.0]), torch.tensor([4.0])]
    per_rank = ([one_f_one_b_actions(0, 1, 3)] if schedule == "1f1b"
                else [GPipe().schedule_actions(1, 3)])
    reports = pipeline_executor.execute_actions(per_rank, _forward_step, iter(data), [chunk], 3,
                                                False, parallel, None, loss_scale=0.5)
    assert [r["num_tokens"].item() for r in reports] == [2.0, 1.0, 1.0]
    assert chunk.weight.grad.item() == pytest.approx(0.5 * 10.0)  # d(sum w*x)/dw, scaled
    assert chunk.synced == [False, False, True]  # sync only on the last backward
    trace = pipeline_executor.last_trace
    assert trace.actions == per_rank[0] and trace.peak_stored == (1 if schedule == "1f1b" else 3)
    chunk.weight.grad = None
    evaluation = pipeline_executor.execute_actions(per_rank, _forward_step, iter(data), [chunk], 3,
                                                   True, parallel, None)
    assert len(evaluation) == 3 and chunk.weight.grad is None
    assert [a.kind for a in pipeline_executor.last_trace.actions] == ["F"] * 3
