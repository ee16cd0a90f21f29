"""QK-clip (``--qk-clip``): after a step, the query and key rows of every query group whose
largest logit exceeded the threshold are scaled so that its logit falls to the threshold,
split between queries and keys by ``--qk-clip-alpha``; rows declared per head (MLA's) take
their role's share; the fp32 main copies alike; a layer under the threshold is left alone; and
what cannot be clipped is refused."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from plugtron.api import ConfigError, mark_fused_parts, mark_qk_clip_rows, record_max_logits
from plugtron.core.blocks.qk_clip import RECORD, clip_qk
from plugtron.core.parallel.distributed import single_process
from plugtron.core.training.loop import setup
from plugtron.core.training.validate import validate
from plugtron_gpt.layers.attention_logits import max_logits

from tests.utils import tiny_config, train_in_process

ONE_RANK = SimpleNamespace(tp_group=None, tp_rank=0, tp_size=1, etp_group=None, etp_rank=0,
                           etp_size=1, dp_cp_group=None)


class _Optimizer:
    def __init__(self):
        self.scaled = []

    def scale_rows_(self, param, scale):
        self.scaled.append(scale)


def test_the_groups_above_the_threshold_are_scaled_down():
    groups, q, kv, hidden = 2, 4, 2, 3  # per group: 2 heads of 2 (4 query rows), 2 key, 2 value
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.ones(groups * (q + 2 * kv), hidden))
    mark_fused_parts(layer.weight, (q, kv, kv), groups=groups, kind="qkv")
    record_max_logits(layer, layer.weight, torch.tensor([10.0, 400.0, 50.0, 20.0]))
    record_max_logits(layer, layer.weight, torch.tensor([1.0, 1.0, 80.0, 1.0]))  # a 2nd batch
    optimizer = _Optimizer()
    largest = clip_qk([layer], optimizer, ONE_RANK, threshold=100.0, alpha=0.25)
    assert largest == 400.0
    rows = layer.weight[:, 0].view(groups, q + 2 * kv)
    eta = 100.0 / 400.0  # group 0's largest; group 1's 80 stays
    assert rows[0, :q].tolist() == pytest.approx([eta ** 0.25] * q)
    assert rows[0, q:q + kv].tolist() == pytest.approx([eta ** 0.75] * kv)
    assert rows[0, q + kv:].tolist() == [1.0] * kv and rows[1].tolist() == [1.0] * (q + 2 * kv)
    assert torch.equal(optimizer.scaled[0].view(groups, -1), rows)
    assert clip_qk([layer], optimizer, ONE_RANK, 100.0, 0.25) == 0.0  # the record was used


def test_the_logit_is_the_causal_maximum_per_head():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 4, 8, generator=g), torch.randn(2, 5, 2, 8, generator=g)
    got = max_logits(q, k)
    for head in range(4):
        scores = torch.einsum("bsd,btd->bst", q[:, :, head], k[:, :, head // 2]) / math.sqrt(8)
        want = scores.masked_fill(torch.ones(5, 5).triu(1).bool(), -math.inf).max()
        assert got[head] == pytest.approx(want.item(), rel=1e-6)


def test_the_logits_are_the_pairs_attention_computes():
    """Inside a document where documents are packed; inside the window with --window-size."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 2, 4, generator=g), torch.randn(2, 6, 1, 4, generator=g)
    documents = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 2]])
    got = max_logits(q, k, document_ids=documents)
    scores = torch.einsum("bshd,btd->bhst", q, k[:, :, 0]) / 2.0
    allowed = (torch.ones(6, 6).tril().bool()[None]
               & (documents[:, :, None] == documents[:, None, :]))[:, None]
    want = scores.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3))
    torch.testing.assert_close(got, want)
    assert (got < max_logits(q, k)).any()  # a pair across documents was the largest
    # --window-size 2,0: a query sees itself and the two keys before it
    near = torch.ones(6, 6).tril().bool() & ~torch.ones(6, 6).tril(-3).bool()
    want = scores.masked_fill(~near[None, None], -math.inf).amax(dim=(0, 2, 3))
    torch.testing.assert_close(max_logits(q, k, window_left=2), want)


def test_a_bf16_run_scales_the_master_copies_with_the_weights():
    config = tiny_config(optimizer="muon", qk_clip=True, qk_clip_threshold=0.05, bf16=True,
                         train_iters=3)
    records, run = train_in_process(config, world=single_process())
    assert all(math.isfinite(r["lm_loss"]) for r in records)
    assert all(r["max_attention_logit"] > 0.05 for r in records)  # each step clipped
    weight = run.model_chunks[0].module.decoder.layers["0"].self_attention.linear_qkv.weight
    main = dict(zip(map(id, run.optimizer.model_params), run.optimizer.main_params))[id(weight)]
    assert torch.equal(main.to(torch.bfloat16), weight)  # clipped, then published alike
    unclipped = train_in_process(tiny_config(optimizer="muon", bf16=True, train_iters=3),
                                 world=single_process())[1]
    other = unclipped.model_chunks[0].module.decoder.layers["0"].self_attention
    assert weight.float().norm() < other.linear_qkv.weight.float().norm()


def test_declared_rows_take_their_role_s_share_per_head():
    """``mark_qk_clip_rows``: per head, query rows ``eta ** alpha``, key rows
    ``eta ** (1 - alpha)``, a query part against a shared key all of ``eta``, values nothing."""
    heads, hidden = 2, 3
    layer = torch.nn.Module()
    layer.q = torch.nn.Parameter(torch.ones(heads * 5, hidden))
    layer.kv = torch.nn.Parameter(torch.ones(heads * 4, hidden))
    mark_qk_clip_rows(layer.q, ((3, "query"), (2, "query_whole")), heads)
    mark_qk_clip_rows(layer.kv, ((3, "key"), (1, "none")), heads)
    record_max_logits(layer, (layer.q, layer.kv), torch.tensor([50.0, 400.0]))
    optimizer = _Optimizer()
    assert clip_qk([layer], optimizer, ONE_RANK, threshold=100.0, alpha=0.25) == 400.0
    eta = 0.25  # head 1's; head 0 stays
    assert layer.q[:, 0].tolist() == pytest.approx([1.0] * 5 + [eta ** 0.25] * 3 + [eta] * 2)
    assert layer.kv[:, 0].tolist() == pytest.approx([1.0] * 4 + [eta ** 0.75] * 3 + [1.0])
    assert len(optimizer.scaled) == 2
    with pytest.raises(ValueError, match="unknown QK-clip row roles"):
        mark_qk_clip_rows(layer.q, ((5, "value"),), heads)


#: A one-layer MLA (with query compression, and YaRN's softmax correction on the queries).
MLA_FLAGS = {"num-layers": 1, "multi-latent-attention": True, "kv-lora-rank": 8,
             "qk-head-dim": 6, "qk-pos-emb-head-dim": 4, "v-head-dim": 5, "q-lora-rank": 12,
             "position-embedding-type": "rope", "normalization": "RMSNorm",
             "add-bias-linear": False, "num-attention-heads": 4, "hidden-size": 32,
             "qk-clip": True, "rope-type": "yarn", "rotary-scaling-factor": 40.0,
             "yarn-original-max-position-embeddings": 16}


@pytest.mark.parametrize("q_rank", [12, None], ids=["q-compressed", "q-uncompressed"])
def test_mla_heads_above_the_threshold_fall_to_it(q_rank):
    """MLA (Megatron-Core's clip): q_nope and k_nope share the scale, q_rope takes all of it
    (the rotary key is shared by the heads and left alone), so every logit of a clipped head is
    multiplied by ``t / m`` and its largest becomes the threshold; the others do not move."""
    from plugtron.core.blocks.rotary import rotary_freqs
    from plugtron.testing import make_config

    flags = {**MLA_FLAGS, **({"q-lora-rank": q_rank} if q_rank else {"q-lora-rank": None})}
    run = setup(make_config({k: v for k, v in flags.items() if v is not None}),
                world=single_process())
    attention = run.model_chunks[0].module.decoder.layers["0"].self_attention
    shared = {n: p.detach().clone() for n, p in attention.named_parameters()
              if "down_proj" in n or "layernorm" in n}
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    rotary = rotary_freqs(16, 4, 10000.0)
    attention(x, rotary)
    before = getattr(attention, RECORD)[1].clone()
    threshold = float(before.median())
    clip_qk([attention], _Optimizer(), ONE_RANK, threshold, alpha=0.3)
    attention(x, rotary)
    after = getattr(attention, RECORD)[1]
    want = torch.clamp(before, max=threshold)
    torch.testing.assert_close(after, want, rtol=1e-5, atol=0)
    assert (before > threshold).any() and (before <= threshold).any()
    for name, value in shared.items():  # the shared rotary key and the latents: untouched
        assert torch.equal(dict(attention.named_parameters())[name], value), name


@pytest.mark.parametrize("flags,message", [
    ({"qk_clip_alpha": 1.0}, "0 < --qk-clip-alpha < 1"),
    ({"bf16": True, "use_distributed_optimizer": True}, "a sharded optimizer"),
])
def test_refusals(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(qk_clip=True, **flags), 2)
