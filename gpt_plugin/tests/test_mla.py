"""Multi-latent attention (``--multi-latent-attention``, issue 27) on one process: Megatron-Core's
parameter names and shapes; the layer's forward and backward against a small reference written
here (DeepSeek's form: pairs of rotary channels turned as complex numbers) and against
transformers' DeepseekV3Attention when transformers is installed (skipped otherwise), with and
without query compression; bad settings exit 2 before launch. fp32; outputs and every gradient
within 1e-5 absolute and relative. Layouts: test_mla_layouts.py."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner
from plugtron.cli.main import cli
from plugtron.core.blocks.rotary import rotary_freqs
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import setup
from plugtron.testing import make_config
from plugtron_gpt.layers.attention_options import rope_scaling

HEADS, QK, POS, V, KV_RANK, Q_RANK = 4, 6, 4, 5, 8, 12
MLA = {"multi-latent-attention": True, "kv-lora-rank": KV_RANK, "qk-head-dim": QK,
       "qk-pos-emb-head-dim": POS, "v-head-dim": V, "position-embedding-type": "rope",
       "normalization": "RMSNorm", "add-bias-linear": False, "num-attention-heads": HEADS,
       "hidden-size": 32, "rotary-base": 10000}
PREFIX = "decoder.layers.0.self_attention"


def attention_config(yarn: bool):
    return make_config({**MLA, **(YARN if yarn else {})})


def _attention(q_rank, **extra):
    flags = {"num-layers": 1, **MLA, **({"q-lora-rank": q_rank} if q_rank else {}), **extra}
    run = setup(make_config(flags), world=single_process())
    return run.model_chunks[0].module.decoder.layers["0"].self_attention


def test_parameters_have_megatron_core_names_and_shapes():
    shapes = {name: tuple(p.shape) for name, p in _attention(Q_RANK).named_parameters()}
    assert shapes == {
        "linear_q_down_proj.weight": (Q_RANK, 32), "q_layernorm.weight": (Q_RANK,),
        "linear_q_up_proj.weight": (HEADS * (QK + POS), Q_RANK),
        "linear_kv_down_proj.weight": (KV_RANK + POS, 32), "kv_layernorm.weight": (KV_RANK,),
        "linear_kv_up_proj.weight": (HEADS * (QK + V), KV_RANK),
        "linear_proj.weight": (32, HEADS * V)}
    no_compression = {name for name, _ in _attention(None).named_parameters()}
    assert no_compression == {"linear_q_proj.weight", "linear_kv_down_proj.weight",
                              "kv_layernorm.weight", "linear_kv_up_proj.weight",
                              "linear_proj.weight"}


def _rms(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _turn_pairs(x, base):
    """DeepSeek's rotary: channel pairs (2i, 2i+1) as one complex number, turned by
    position x base^(-2i/d)."""
    s, d = x.shape[1], x.shape[-1]
    angles = torch.outer(torch.arange(s, dtype=torch.float64),
                         base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
    turn = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)


def reference_mla(x, w: dict, base: float) -> torch.Tensor:
    """Multi-latent attention written out from the DeepSeek-V2 paper's equations."""
    b, s, _ = x.shape
    if "linear_q_proj.weight" in w:
        q = x @ w["linear_q_proj.weight"].T
    else:
        q = _rms(x @ w["linear_q_down_proj.weight"].T, w["q_layernorm.weight"]) \
            @ w["linear_q_up_proj.weight"].T
    q = q.view(b, s, HEADS, QK + POS)
    latent, k_rope = (x @ w["linear_kv_down_proj.weight"].T).split([KV_RANK, POS], -1)
    kv = (_rms(latent, w["kv_layernorm.weight"]) @ w["linear_kv_up_proj.weight"].T)
    k_nope, v = kv.view(b, s, HEADS, QK + V).split([QK, V], -1)
    q = torch.cat([q[..., :QK], _turn_pairs(q[..., QK:], base)], -1)
    k_rope = _turn_pairs(k_rope[:, :, None, :], base).expand(b, s, HEADS, POS)
    k = torch.cat([k_nope, k_rope], -1)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(QK + POS)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    context = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, HEADS * V)
    return context @ w["linear_proj.weight"].T


def _forward_backward(fn, x, params):
    x = x.clone().requires_grad_(True)
    out = fn(x)
    grads = torch.autograd.grad(out, [x, *params],
                                torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
    return out.detach(), grads[0], list(grads[1:])


def _close(got, want):
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_rank", [Q_RANK, None], ids=["q-compressed", "q-uncompressed"])
def test_forward_and_backward_equal_the_reference(q_rank):
    attention = _attention(q_rank)
    names = [name for name, _ in attention.named_parameters()]
    params = [p for _, p in attention.named_parameters()]
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    rotary = rotary_freqs(16, POS, 10000.0)
    got = _forward_backward(lambda t: attention(t, rotary), x, params)
    copies = {n: p.detach().clone().requires_grad_(True) for n, p in zip(names, params)}
    want = _forward_backward(lambda t: reference_mla(t, copies, 10000.0), x,
                             list(copies.values()))
    _close(got[0], want[0])
    _close(got[1], want[1])
    for name, g, r in zip(names, got[2], want[2]):
        _close(g, r)


#: DeepSeek-V3's YaRN (factor 40, mscale = mscale_all_dim = 1: cos and sin unscaled, the
#: softmax scale times (0.1 ln 40 + 1)^2), its original context shrunk to the test's sequence
#: so that the ramp falls inside the 4 rotary channels.
YARN = {"rope-type": "yarn", "rotary-scaling-factor": 40.0, "mscale": 1.0,
        "mscale-all-dim": 1.0, "yarn-original-max-position-embeddings": 16}
HF_YARN = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
           "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}


@pytest.mark.parametrize("q_rank", [Q_RANK, None], ids=["q-compressed", "q-uncompressed"])
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_forward_and_backward_equal_transformers(q_rank, yarn):
    deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config
    # transformers' latent norms keep their default eps (1e-6) whatever rms_norm_eps says
    attention = _attention(q_rank, **{"norm-epsilon": 1e-6}, **(YARN if yarn else {}))
    rope = {"rope_parameters": {"rope_theta": 10000.0, **HF_YARN}} if yarn else \
        {"rope_theta": 10000.0}
    hf_config = DeepseekV3Config(
        hidden_size=32, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=q_rank, kv_lora_rank=KV_RANK, qk_nope_head_dim=QK, qk_rope_head_dim=POS,
        v_head_dim=V, rms_norm_eps=1e-5, attention_bias=False, attention_dropout=0.0,
        rope_interleave=True, max_position_embeddings=64, **rope)
    hf_config._attn_implementation = "eager"
    hf = deepseek.DeepseekV3Attention(hf_config, layer_idx=0)
    names = {"linear_q_proj": "q_proj", "linear_q_down_proj": "q_a_proj",
             "q_layernorm": "q_a_layernorm", "linear_q_up_proj": "q_b_proj",
             "linear_kv_down_proj": "kv_a_proj_with_mqa", "kv_layernorm": "kv_a_layernorm",
             "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}
    ours = dict(attention.named_parameters())
    theirs = dict(hf.named_parameters())
    with torch.no_grad():
        for name, p in ours.items():
            module, leaf = name.rsplit(".", 1)
            theirs[f"{names[module]}.{leaf}"].copy_(p)
    assert len(theirs) == len(ours)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    rope = deepseek.DeepseekV3RotaryEmbedding(hf_config)
    if yarn:  # the correction is really there, on both sides
        correction = (0.1 * math.log(40) + 1) ** 2
        assert hf.scaling == pytest.approx((QK + POS) ** -0.5 * correction, rel=1e-12)
        assert attention.query_scale == pytest.approx(correction, rel=1e-12)
        default = 1.0 / 10000 ** (torch.arange(0, POS, 2).float() / POS)
        assert not torch.equal(rope.inv_freq, default)
    positions = torch.arange(16)[None].expand(2, 16)
    cos_sin = rope(x, positions)
    mask = torch.full((16, 16), float("-inf")).triu(1)[None, None].expand(2, 1, 16, 16)
    freqs = rotary_freqs(16, POS, 10000.0, scaling=rope_scaling(attention_config(yarn)))
    got = _forward_backward(lambda t: attention(t, freqs), x, list(ours.values()))
    order = [f"{names[n.rsplit('.', 1)[0]]}.{n.rsplit('.', 1)[1]}" for n in ours]
    want = _forward_backward(lambda t: hf(t, cos_sin, mask)[0], x,
                             [theirs[n] for n in order])
    _close(got[0], want[0])
    _close(got[1], want[1])
    for g, r in zip(got[2], want[2]):
        _close(g, r)


TINY = ["--preset", "tiny", "--data", "mock", "--vocab-size", "64", "--train-iters", "1",
        "--no-progress", "--eval-interval", "0"]
ON = ["--multi-latent-attention", "--position-embedding-type", "rope"]


@pytest.mark.parametrize("args,message", [
    (["--multi-latent-attention"], "it needs --position-embedding-type rope"),
    ([*ON, "--qk-pos-emb-head-dim", "3"], "--qk-pos-emb-head-dim 3 must be even"),
    ([*ON, "--kv-lora-rank", "0"], "--kv-lora-rank must be at least 1"),
    ([*ON, "--num-query-groups", "1"], "leave --num-query-groups unset"),
    ([*ON, "--qk-layernorm"], "--qk-layernorm is an option of the standard attention"),
    ([*ON, "--v-head-dim", "256", "--nproc-per-node", "2", "--cp", "2",
      "--attention-dropout", "0"], "use --cp-comm-type a2a"),
])
def test_bad_settings_exit_2_before_launch(args, message):
    result = CliRunner().invoke(cli, ["train", *TINY, *args], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_other_layer_backends_are_refused():
    """(The CLI refuses te earlier on a machine without it; the rule is the layer type's.)"""
    from plugtron.api import ConfigError
    from plugtron_gpt.layers.attention_options import validate_attention
    with pytest.raises(ConfigError, match="implemented with the 'local' layer backend"):
        validate_attention(make_config({**MLA, "layer-backend": "te"}))


PROMPTS = [[5, 17, 3, 9, 42], [7, 1], [88, 2, 64]]  # different lengths: left padding


@pytest.fixture(scope="module")
def mla_checkpoint(tmp_path_factory):
    """An MLA model (q compression, YaRN, and an MTP layer, which generation skips; 2 layers)
    saved after one training step."""
    from plugtron.core import checkpoint
    from plugtron.core.monitoring.metrics import MetricsLogger
    from plugtron.core.training import loop as training

    path = str(tmp_path_factory.mktemp("mla") / "ck")
    config = make_config({**MLA, **YARN, "num-layers": 2, "q-lora-rank": Q_RANK,
                          "mtp-num-layers": 1, "train-iters": 1, "save": path,
                          "init-method-std": 0.2})
    run = training.setup(config, world=single_process())
    checkpoint.load_if_requested(run)
    training.train(run, MetricsLogger(config, rank=1))
    return path


def test_generation_caches_the_latent(mla_checkpoint):
    """The cache of each MLA layer holds the normed latent (kv_lora_rank per token) and the
    rotated shared key (qk_pos_emb_head_dim per token), not the expanded keys and values; cached
    greedy generation equals generation without a cache and the full-sequence argmax, with
    prompts of different lengths (left padding)."""
    from plugtron.api import InferenceState, forward_context, generate, load_model

    model = load_model(mla_checkpoint)
    state = InferenceState(torch.ones(2, 7, dtype=torch.bool))
    with forward_context(inference=state), torch.no_grad():
        model.module(torch.tensor([PROMPTS[0], PROMPTS[0][::-1]]))
    keys = [f"decoder.layers.{i}.self_attention" for i in range(2)]
    for key in keys:
        latent, k_rope = state.cached(key)
        assert latent.shape == (2, 7, KV_RANK) and k_rope.shape == (2, 7, 1, POS)
        assert state.bytes_per_token(key) == (KV_RANK + POS) * 4  # fp32
    assert state.bytes_per_token() == 2 * (KV_RANK + POS) * 4  # nothing else is cached
    expanded = HEADS * (QK + POS + V) * 4  # what caching k and v would hold: 240 bytes
    assert expanded == 5 * state.bytes_per_token(keys[0])

    cached = generate(model, PROMPTS, 6, greedy=True)
    assert cached.tokens == generate(model, PROMPTS, 6, greedy=True, use_cache=False).tokens
    for prompt, tokens in zip(PROMPTS, cached.tokens):
        sequence = list(prompt)
        for _ in range(6):
            with torch.no_grad():
                logits = model(torch.tensor([sequence]))
            sequence.append(int(logits[0, -1, :128].argmax()))
        assert tokens == sequence[len(prompt):]


def test_tp2_generation_gives_the_tokens_of_tp1(mla_checkpoint):
    """Through the launcher, two ranks with two heads each: each rank caches the whole latent
    (the down-projection is replicated) and rebuilds its own heads' keys and values."""
    import json
    import os
    import subprocess
    import sys

    from plugtron.api import generate, load_model

    args = ["generate", "--load", mla_checkpoint, "--greedy", "--max-new-tokens", "5",
            "--json", "--nproc-per-node", "2", "--tp", "2", "--device", "cpu",
            *[a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "plugtron.cli.main", *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    expected = generate(load_model(mla_checkpoint), PROMPTS, 5, greedy=True).tokens
    assert [line["tokens"] for line in lines] == expected
