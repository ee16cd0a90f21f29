"""Pipeline parallelism on 8 gloo ranks against the single-process run (one pool per module).

Every layout of the issue's matrix (pp, vp, M) in {(2,1,4), (4,1,8), (2,2,4), (4,2,8)} runs each
schedule that applies to it for 5 iterations; the global batch is 16 everywhere, so dp (the
rest of the 8 ranks) does not change the losses (token-weighted). Tied embeddings on (2,1,4) and
(4,2,8), untied on the other two. Tolerance: losses and grad norms relative 1e-5, parameters
1e-5 (fp32).
"""

import json
import weakref

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.distributed import single_process
from plugtron.core.pipeline import executor as pipeline_executor
from plugtron.core.pipeline.p2p import P2PCommunicator
from plugtron.core.training import loop as training

from tests.distributed.harness import worker_cache
from tests.schedule_helpers import RandomOrderSchedule
from tests.utils import tiny_config, train_in_process

WORLD = 8
BASE = {"num_layers": 8, "hidden_size": 32, "seq_length": 16, "global_batch_size": 16,
        "micro_batch_size": 1, "train_iters": 5, "eval_iters": 1}
# (pp, vp, schedule, tied); M = 16 / dp = 2 * pp.
RUNS = [(2, None, "1f1b", True), (2, None, "gpipe", True), (2, None, "interleaved-1f1b", True),
        (4, None, "1f1b", False), (4, None, "gpipe", False),
        (2, 2, "interleaved-1f1b", False), (2, 2, "gpipe", False),
        (4, 2, "interleaved-1f1b", True), (4, 2, "gpipe", True),
        (4, 2, "random-order", True),
        # the split backward (I + W), on the tied and the untied layout
        (2, None, "zb-h1", True), (4, None, "zb-h1", False)]


def config_for(pp=1, vp=None, schedule="auto", tied=True, **extra):
    overrides = dict(BASE, pp=pp, untie_embeddings_and_output_weights=not tied, **extra)
    if vp:
        overrides["vp"] = vp
    overrides["schedule"] = "interleaved-1f1b" if schedule == "random-order" else schedule
    return tiny_config(**overrides)


def global_params(run) -> dict:
    """Parameters by layout-free name; a tied output-layer copy is reported under the
    embedding's name with a suffix so both copies are compared."""
    out = {}
    for chunk in run.model_chunks:
        for name, p in chunk.module.named_parameters():
            if name == "output_layer.weight" and getattr(p, "shared_group", None):
                name = "embedding.word_embeddings.weight@output"
            out[name] = p.detach().clone()
    return out


def _train(rank, world_size, pp, vp, schedule, tied, **extra):
    config = config_for(pp, vp, schedule, tied, **extra)
    if schedule == "random-order":
        run = training.setup(config, world=None)
        run.pm.unregister(name="schedule:interleaved-1f1b")
        run.pm.register(RandomOrderSchedule(seed=7))
        # Exercise the NCCL way on gloo: receives stay in the batch of their step.
        run.p2p.receives_run_ahead = False
        from plugtron.core.monitoring.metrics import MetricsLogger

        from tests.utils import StepRecorder
        recorder = StepRecorder()
        run.pm.register(recorder)
        training.train(run, MetricsLogger(config, rank=1))
        records = recorder.records
    else:
        records, run = train_in_process(config)
    trace = pipeline_executor.last_trace
    valid = training.evaluate(run)
    par = run.parallel
    params = global_params(run) if par.dp_rank == 0 else None
    alive = outputs_alive_at_forwards(run) if schedule == "gpipe" else None
    return {"alive_outputs": alive, "pp_rank": par.pp_rank, "dp_rank": par.dp_rank,
            "losses": [r["lm_loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records], "valid": valid,
            "actions": [a.to_dict() for a in trace.actions], "peak_stored": trace.peak_stored,
            "params": params}


def outputs_alive_at_forwards(run) -> int:
    """Most earlier forward outputs still alive when a forward starts, over one more step.
    Under gpipe every forward comes before any backward, so a kept activation would show."""
    refs, most = [], 0
    base = run.forward_step_func

    def counting_forward_step(data_iterator, model):
        nonlocal most
        most = max(most, sum(ref() is not None for ref in refs))
        output, closure = base(data_iterator, model)
        refs.append(weakref.ref(output))
        return output, closure

    run.forward_step_func = counting_forward_step
    training.run_schedule(run, training.data_iterators(run, run.datasets[0], 0), False)
    return most


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(WORLD, timeout=300)


@pytest.fixture(scope="module")
def references():
    """Single-process pp 1 runs with the same global batch, in the test process."""
    out = {}
    for tied in (True, False):
        records, run = train_in_process(config_for(tied=tied), world=single_process())
        out[tied] = {"losses": [r["lm_loss"] for r in records],
                     "grad_norms": [r["grad_norm"] for r in records],
                     "valid": training.evaluate(run), "params": global_params(run)}
    return out


@pytest.fixture(scope="module")
def results(pool):
    return {run: pool.run(_train, *run) for run in RUNS}


@pytest.mark.parametrize("layout", RUNS, ids=lambda r: "-".join(map(str, r)))
def test_losses_grad_norms_and_params_match_single_process(layout, results, references):
    ref = references[layout[3]]
    ranks = results[layout]
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
        assert r["valid"] == pytest.approx(ref["valid"], rel=1e-5)  # forward-only schedule
    gathered = {}
    for r in ranks:
        if r["params"] is not None:
            gathered.update(r["params"])
    expected = dict(ref["params"])
    if layout[3]:  # tied: the last stage's copy must equal the embedding too
        expected["embedding.word_embeddings.weight@output"] = expected[
            "embedding.word_embeddings.weight"]
    assert sorted(gathered) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(gathered[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_schedules_agree_on_the_same_layout(results):
    for pp, vp, tied, schedules in [(2, None, True, ("1f1b", "gpipe", "interleaved-1f1b")),
                                    (4, None, False, ("1f1b", "gpipe")),
                                    (2, 2, False, ("interleaved-1f1b", "gpipe")),
                                    (4, 2, True, ("interleaved-1f1b", "gpipe", "random-order"))]:
        losses = [results[(pp, vp, s, tied)][-1]["losses"] for s in schedules]
        for other in losses[1:]:
            assert other == pytest.approx(losses[0], rel=1e-6), (pp, vp, schedules)


def test_executed_order_is_what_schedule_show_prints(results):
    runner = CliRunner()
    for (pp, vp, schedule, _), ranks in results.items():
        if schedule == "random-order":
            continue
        args = ["schedule", "show", "--schedule", schedule, "--pp", str(pp), "-m", str(2 * pp),
                "--json"] + (["--vp", str(vp)] if vp else [])
        out = runner.invoke(cli, args)
        assert out.exit_code == 0, out.output
        shown = {r["rank"]: r for r in json.loads(out.output)["ranks"]}
        for r in ranks:
            assert r["actions"] == shown[r["pp_rank"]]["actions"], (schedule, r["pp_rank"])
            assert r["peak_stored"] == shown[r["pp_rank"]]["peak_stored_activations"]


def test_uneven_interleaved_stages_match_single_process(pool, references):
    # 8 layers over pp 2 x vp 2 with 2 on the first stage: chunks of 1, 3, 1, 3 layers.
    ranks = pool.run(_train, 2, 2, "interleaved-1f1b", True,
                     decoder_first_pipeline_num_layers=2)
    layers = {r["pp_rank"]: sorted({n.split(".")[2] for n in r["params"]
                                    if n.startswith("decoder.layers.")})
              for r in ranks if r["params"] is not None}
    assert layers == {0: ["0", "4"], 1: ["1", "2", "3", "5", "6", "7"]}
    for r in ranks:
        assert r["losses"] == pytest.approx(references[True]["losses"], rel=1e-5)


def test_sent_activations_are_released(results):
    for (pp, vp, schedule, tied), ranks in results.items():
        if schedule == "gpipe":
            assert all(r["alive_outputs"] == 0 for r in ranks if r["pp_rank"] < pp - 1)


def test_first_stage_activation_peak(results):
    for pp in (2, 4):
        m = 2 * pp
        first = [r for r in results[(pp, None, "1f1b", pp == 2)] if r["pp_rank"] == 0]
        assert all(r["peak_stored"] <= pp for r in first)
        first = [r for r in results[(pp, None, "gpipe", pp == 2)] if r["pp_rank"] == 0]
        assert all(r["peak_stored"] == m for r in first)


def _p2p_patterns(rank, world_size, pp):
    cache = worker_cache()
    if ("pp", pp) not in cache:
        cache[("pp", pp)] = ParallelContext.build(world_size, rank, pp=pp)
    par = cache[("pp", pp)]
    p2p = P2PCommunicator(par, (2, 3, 4), torch.float32, "cpu")
    first, last, me = par.pp_rank == 0, par.pp_rank == pp - 1, float(par.pp_rank)
    # A forward chain and a backward chain, each hop adding one.
    x = torch.zeros(2, 3, 4) if first else p2p.recv_forward() + 1
    if not last:
        p2p.send_forward(x)
    g = torch.zeros(2, 3, 4) if last else p2p.recv_backward() + 1
    if not first:
        p2p.send_backward(g)
    # Megatron's steady-state pairs: stage 2k sends forward and receives backward from 2k+1.
    if par.pp_rank % 2 == 0:
        paired = p2p.send_forward_recv_backward(torch.full((2, 3, 4), me))
    else:
        paired = p2p.send_backward_recv_forward(torch.full((2, 3, 4), me))
    # One batch with an activation and a gradient for the same peer (pp 2) or for both.
    both = p2p.exchange(send_next=torch.full((2, 3, 4), 10 + me),
                        send_prev=torch.full((2, 3, 4), 20 + me), recv_prev=True,
                        recv_next=True).wait()
    return (x[0, 0, 0].item(), g[0, 0, 0].item(), paired[0, 0, 0].item(),
            both.from_prev[0, 0, 0].item(), both.from_next[0, 0, 0].item())


@pytest.mark.parametrize("pp", [2, 4])
def test_p2p_communicator(pool, pp):
    for rank, (x, g, paired, from_prev, from_next) in enumerate(pool.run(_p2p_patterns, pp)):
        stage = rank // (WORLD // pp)
        assert x == stage and g == pp - 1 - stage
        assert paired == (stage + 1 if stage % 2 == 0 else stage - 1)
        # Activations come from the previous stage, gradients from the next (wrapping around).
        assert from_prev == 10 + (stage - 1) % pp and from_next == 20 + (stage + 1) % pp
