"""``plugtron.api.generate`` and ``plugtron generate``: the KV cache gives the tokens of the
uncached loop, a left-padded batch gives each row's tokens alone, greedy output equals
transformers' ``generate(do_sample=False)`` on the exported model token for token (tiny random
Llama- and GPT-2-layout models), stops at eod and --stop strings, bad input exits 2, and tp 2
gives the tokens of tp 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from plugtron.api import generate, load_model
from plugtron.cli.main import cli
from plugtron.core import checkpoint
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.distributed import single_process
from plugtron.core.tools.generation import InferenceState, sample
from plugtron.core.training import loop as training

from tests.utils import tiny_config

PROMPTS = [[5, 17, 3, 9, 42], [7, 1], [88, 2, 64]]  # different lengths: left padding


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    """A tiny rope + GQA GPT trained two steps (so its logits are not uniform)."""
    path = str(tmp_path_factory.mktemp("gen") / "ck")
    config = tiny_config(train_iters=2, save=path, position_embedding_type="rope",
                         num_query_groups=2, normalization="RMSNorm", swiglu=True,
                         init_method_std=0.2)
    run = training.setup(config, world=single_process())
    checkpoint.load_if_requested(run)  # also makes the checkpointer that saves at the end
    training.train(run, MetricsLogger(config, rank=1))
    return path


def _reference(module, prompt, n):
    """Greedy by hand: the whole sequence every step, no cache, no padding."""
    ids = list(prompt)
    for _ in range(n):
        logits = module(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_cached_uncached_and_padded_rows_agree(gpt_checkpoint):
    model = load_model(gpt_checkpoint)
    cached = generate(model, PROMPTS, 6, greedy=True)
    uncached = generate(model, PROMPTS, 6, greedy=True, use_cache=False)
    assert cached.tokens == uncached.tokens
    assert cached.finish_reasons == ["length"] * 3
    for prompt, tokens in zip(PROMPTS, cached.tokens):
        assert tokens == _reference(model, prompt, 6)
    # Sampling: the same seed gives the same draws, with and without the cache.
    a = generate(model, PROMPTS, 5, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    b = generate(model, PROMPTS, 5, temperature=0.8, top_k=20, top_p=0.9, seed=3,
                 use_cache=False)
    assert a.tokens == b.tokens


class Letters:
    """A tokenizer of letters: id i is chr(65 + i % 26); eod is given by the test."""

    def __init__(self, eod):
        self.eod = eod

    def tokenize(self, text):
        return [ord(c) - 65 for c in text]

    def detokenize(self, ids):
        return "".join(chr(65 + int(i) % 26) for i in ids)


def test_stops_at_eod_and_at_stop_strings(gpt_checkpoint):
    model = load_model(gpt_checkpoint)
    free = generate(model, PROMPTS[:1], 8, greedy=True).tokens[0]
    at_eod = generate(model, PROMPTS[:1], 8, greedy=True, eod=free[2])
    first = free.index(free[2])
    assert at_eod.tokens[0] == free[:first + 1] and at_eod.finish_reasons == ["eod"]
    stop = Letters(None).detokenize(free[3:5])
    letters = Letters(eod=None)
    stopped = generate(model, ["FRDJ"], 8, greedy=True, tokenizer=letters, stop=[stop])
    alone = generate(model, [letters.tokenize("FRDJ")], 8, greedy=True).tokens[0]
    text = letters.detokenize(alone)
    assert stopped.finish_reasons == ["stop"] or stop not in text
    if stop in text:
        assert stopped.texts[0] == text[:text.index(stop)]


def test_sampling_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, False, 1.0, 2, 1.0, g)) for _ in range(50)}
    assert draws <= {0, 1} and len(draws) == 2  # top-k 2
    draws = {int(sample(logits, False, 1.0, 0, 0.5, g)) for _ in range(50)}
    assert draws == {0}  # token 0 alone holds 66% > top-p 0.5
    assert int(sample(logits, True, 1.0, 0, 1.0, None)) == 0


def test_attention_mask_is_causal_with_an_offset_and_hides_padding():
    state = InferenceState(torch.tensor([[False, True, True, True]]))
    mask = state.attention_mask(1, 4)[0, 0, 0]
    assert mask.tolist() == [False, True, True, True]
    full = state.attention_mask(4, 4)[0, 0]
    assert full[0].tolist() == [True, False, False, False]  # padding sees only itself
    assert full[2].tolist() == [False, True, True, False]


def test_the_cache_appends_any_per_token_tensors():
    """``update(key, *tensors)``: each tensor's prefix comes back, in order, whatever its
    trailing shape and dtype (a layer may cache k and v, or what it rebuilds them from)."""
    state = InferenceState(torch.ones(2, 5, dtype=torch.bool))
    a, b = torch.randn(2, 3, 8), torch.randn(2, 3, 1, 4, dtype=torch.float64)
    assert all(torch.equal(x, y) for x, y in zip(state.update("l0", a, b), (a, b)))
    assert [t.shape for t in state.cached("l0")] == [(2, 5, 8), (2, 5, 1, 4)]
    state.advance(3)
    a2, b2 = torch.randn(2, 1, 8), torch.randn(2, 1, 1, 4, dtype=torch.float64)
    got_a, got_b = state.update("l0", a2, b2)
    assert torch.equal(got_a, torch.cat([a, a2], 1)) and torch.equal(got_b, torch.cat([b, b2], 1))
    state.update("l1", a2)
    assert state.bytes_per_token("l0") == 8 * 4 + 4 * 8 and state.bytes_per_token() == 96
    with pytest.raises(ValueError, match="cached 2 tensors and now gives 1"):
        state.update("l0", a2)
    uncached = InferenceState(torch.ones(2, 5, dtype=torch.bool), use_cache=False)
    assert all(x is y for x, y in zip(uncached.update("l0", a, b), (a, b)))
    assert uncached.bytes_per_token() == 0


def test_bad_arguments_are_value_errors(gpt_checkpoint):
    model = load_model(gpt_checkpoint)
    for kwargs, match in [({"max_new_tokens": 0}, "positive"),
                          ({"prompts": [[]]}, "empty"), ({"prompts": [[1000]]}, "vocabulary"),
                          ({"prompts": ["abc"]}, "tokenizer"), ({"temperature": 0}, "greedy")]:
        args = {"prompts": PROMPTS, "max_new_tokens": 2, **kwargs}
        with pytest.raises(ValueError, match=match):
            generate(model, args.pop("prompts"), args.pop("max_new_tokens"), **args)


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hello"], "names no tokenizer"),
    (["--prompt-ids", ""], "is empty"),
    (["--max-new-tokens", "3"], "give a prompt"),
    (["--prompt-ids", "1,x"], "integers"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "at least 1"),
    (["--prompt-ids", "1", "--top-p", "0"], "top-p"),
    (["--prompt-ids", "1", "--pp", "2"], "--pp 2 is not supported"),
    (["--prompt-ids", "1", "--tp", "3", "--nproc-per-node", "3"], "must divide"),
    (["--prompt-ids", "1", "--tp", "2"], "needs exactly 2 ranks"),
    (["--prompt-ids", "100"], "outside the model's vocabulary"),
    (["--prompt-ids", "1", "--chat"], "not --prompt-ids"),
    (["--prompt", "hi", "--chat", "--tokenizer-type", "ByteTokenizer"], "(ByteTokenizer) has none"),
    (["--prompt-ids", "1", "--system", "be brief"], "use it with --chat"),
])
def test_cli_refuses_bad_input_with_exit_2(gpt_checkpoint, args, message):
    if "--max-new-tokens" not in args:
        args = [*args, "--max-new-tokens", "3"]
    result = CliRunner().invoke(cli, ["generate", "--load", gpt_checkpoint, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_cli_prints_the_api_tokens(gpt_checkpoint):
    result = CliRunner().invoke(cli, ["generate", "--load", gpt_checkpoint, "--greedy",
                                      "--max-new-tokens", "4", "--json",
                                      *[a for p in PROMPTS for a in
                                        ("--prompt-ids", ",".join(map(str, p)))]])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    expected = generate(load_model(gpt_checkpoint), PROMPTS, 4, greedy=True).tokens
    assert [line["tokens"] for line in lines] == expected
    streamed = CliRunner().invoke(cli, ["generate", "--load", gpt_checkpoint, "--greedy",
                                        "--max-new-tokens", "4", "--prompt-ids", "5,17,3"])
    assert streamed.exit_code == 0, streamed.output
    assert streamed.output.split()[-4:] == [str(t) for t in generate(
        load_model(gpt_checkpoint), [[5, 17, 3]], 4, greedy=True).tokens[0]]


def test_tp2_gives_the_tokens_of_tp1(gpt_checkpoint):
    """Through the launcher: two ranks, each with half the heads; rank 0 prints."""
    args = ["generate", "--load", gpt_checkpoint, "--greedy", "--max-new-tokens", "5",
            "--json", "--nproc-per-node", "2", "--tp", "2", "--device", "cpu",
            *[a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "plugtron.cli.main", *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    expected = generate(load_model(gpt_checkpoint), PROMPTS, 5, greedy=True).tokens
    assert [line["tokens"] for line in lines] == expected


def test_hybrid_cache_carries_the_mamba_state(tmp_path, monkeypatch):
    """Mamba layers keep their conv window and SSM state between steps; padding is a no-op for
    the recurrence: cached == uncached == each row alone by hand. The scan's final state
    equals the token-by-token recurrence's."""
    from plugtron_gpt.hybrid.ssd import sequential_scan, ssd_final_state, ssd_step

    g = torch.Generator().manual_seed(0)
    x, B = torch.randn(2, 7, 4, 3, generator=g), torch.randn(2, 7, 2, 5, generator=g)
    dt, A = torch.rand(2, 7, 4, generator=g), -torch.rand(4, generator=g)
    zero = torch.zeros(2, 4, 3, 5)
    y, state = ssd_step(zero, x, dt, A, B, B)
    assert torch.allclose(y, sequential_scan(x, dt, A, B, B), atol=1e-5)
    assert torch.allclose(ssd_final_state(x, dt, A, B), state, atol=1e-5)

    path = str(tmp_path / "hy")
    config = tiny_config(train_iters=1, save=path, model="hybrid", hybrid_layer_pattern="M*-",
                         num_layers=3, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
                         mamba_chunk_size=4, init_method_std=0.2)
    run = training.setup(config, world=single_process())
    checkpoint.load_if_requested(run)
    training.train(run, MetricsLogger(config, rank=1))
    model = load_model(path)
    cached = generate(model, PROMPTS, 5, greedy=True)
    assert cached.tokens == generate(model, PROMPTS, 5, greedy=True, use_cache=False).tokens
    assert cached.tokens == [_reference(model, prompt, 5) for prompt in PROMPTS]
    # A layer type that does not declare cache support: no cache, one row at a time.
    from plugtron_gpt.hybrid.mamba import MambaLayer

    monkeypatch.setattr(MambaLayer, "supports_kv_cache", False)
    assert generate(model, PROMPTS, 5, greedy=True).tokens == cached.tokens
    with pytest.raises(ValueError, match="use_cache=False"):
        generate(model, PROMPTS, 2, use_cache=True)


def test_sliding_window_holds_in_the_cache(tmp_path):
    """--window-size 2 (each token sees itself and 2 before): cached generation past the window
    equals the windowed full-sequence forward, row by row, with left padding."""
    path = str(tmp_path / "win")
    config = tiny_config(train_iters=1, save=path, position_embedding_type="rope",
                         window_size="2,0", init_method_std=0.2)
    run = training.setup(config, world=single_process())
    checkpoint.load_if_requested(run)
    training.train(run, MetricsLogger(config, rank=1))
    model = load_model(path)
    cached = generate(model, PROMPTS, 6, greedy=True)
    assert cached.tokens == [_reference(model, prompt, 6) for prompt in PROMPTS]
    assert cached.tokens == generate(model, PROMPTS, 6, greedy=True, use_cache=False).tokens
