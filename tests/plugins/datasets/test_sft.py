"""``--data sft``: instruction records with the loss on the answers, packed.

Packing changes nothing but speed: the same records trained packed and one per sequence give the
same losses and grad norms (relative 1e-5, fp32), and packed runs at tp 2, pp 2 and dp 2 equal
one process (1e-5). The pieces: packs hold each record once within ``--seq-length``; a pack's
positions, labels, loss and document numbers are each record's own; the loss counts responses
and assistant turns only; every bad record is refused naming its file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from plugtron.api import ConfigError
from plugtron.cli.main import cli
from plugtron.plugins.datasets.sft_packing import pack, packed_sample
from plugtron.plugins.datasets.sft_records import read_records, render
from plugtron.plugins.tokenizers.null import NullTokenizer
from plugtron.testing import assert_layouts_match, train_run

VOCAB = 128  # NullTokenizer: records are written as ids; 127 ends a document


def _pairs(path, count=8, prompt=9, response=4, seed=0):
    """``count`` records of ``prompt`` + ``response`` ids: ``prompt + response + 1`` tokens."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(count):
            ids = rng.integers(0, VOCAB - 1, prompt + response)
            f.write(json.dumps({"prompt": " ".join(map(str, ids[:prompt])),
                                "response": " ".join(map(str, ids[prompt:]))}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    # 8 records of 14 tokens (13 positions): two to a sequence of 32, so 4 packs.
    return _pairs(tmp_path_factory.mktemp("sft") / "pairs.jsonl")


def _flags(path, **extra):
    return {"data": "sft", "data-path": path, "tokenizer-type": "NullTokenizer",
            "vocab-size": VOCAB, "seq-length": 32, "split": "100,0,0", "lr": 1e-2, **extra}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize("order", ["ffd", "in-order"])
def test_packs_hold_each_record_once_within_the_sequence(order):
    lengths = [10, 30, 5, 17, 2, 33, 9, 12, 25, 8]  # positions: length - 1
    packs = pack(lengths, 32, order, window=4)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] - 1 for i in p) <= 32 for p in packs)
    assert packs == pack(lengths, 32, order, window=4)  # deterministic
    if order == "ffd":  # within a window, the longest goes first
        assert packs[0][0] == 1


def test_a_packed_sample_is_each_records_own():
    a, b = np.array([5, 6, 7, 8]), np.array([9, 10, 11])
    ta, tb = np.array([0, 0, 1, 1], bool), np.array([0, 1, 1], bool)
    s = packed_sample([(a, ta), (b, tb)], 8, document_ids=True)
    assert s["tokens"].tolist() == [5, 6, 7, 9, 10, 0, 0, 0]
    assert s["labels"].tolist() == [6, 7, 8, 10, 11, 0, 0, 0]
    assert s["loss_mask"].tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
    assert s["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert s["attention_mask"].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    alone = packed_sample([(a, ta)], 8, document_ids=False)
    assert "attention_mask" not in alone and alone["loss_mask"].sum() == 2


# --------------------------------------------------------------------------- records


def test_a_pair_learns_its_response_and_end(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1 2 3", "response": "4 5"}) + "\n")
    (where, record), = read_records(str(path))
    doc = render(record, where, NullTokenizer(vocab_size=VOCAB), "{prompt}\n", False)
    assert doc.tokens.tolist() == [1, 2, 3, 4, 5, VOCAB - 1]
    assert doc.targets.tolist() == [False, False, False, True, True, True]
    assert render(record, where, NullTokenizer(vocab_size=VOCAB), "{prompt}\n",
                  True).targets.all()


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A byte-level HF tokenizer with a small chat template, saved as users have them."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
                          "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    fast.save_pretrained(folder)
    from plugtron.plugins.tokenizers.huggingface import HuggingFaceTokenizer

    return HuggingFaceTokenizer(str(folder))


def test_a_chat_learns_the_assistant_turns_only(chat_tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "ciao"}]
    doc = render({"messages": messages}, "f:1", chat_tokenizer, "{prompt}\n", False)
    learned = chat_tokenizer.detokenize(doc.tokens[doc.targets])
    assert learned == "hello<|end|>ciao<|end|>"
    assert chat_tokenizer.detokenize(doc.tokens) == (
        "<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>hello<|end|><|user|>bye<|end|>"
        "<|assistant|>ciao<|end|>")


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "1 2"', "f.jsonl:2: not valid JSON"),
    ('[1, 2]', "f.jsonl:2: a record is a JSON object"),
    ('{"text": "1 2"}', "f.jsonl:2: a record needs 'messages'"),
    ('{"prompt": "1 x", "response": "2"}', "f.jsonl:2: the tokenizer refused the text"),
    ('{"messages": [{"role": "user", "content": "1"}]}', "f.jsonl:2: chat records"),
])
def test_bad_records_are_named_by_file_and_line(tmp_path, line, message):
    path = tmp_path / "f.jsonl"
    path.write_text('{"prompt": "1", "response": "2"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=message):
        for where, record in read_records(str(path)):
            render(record, where, NullTokenizer(vocab_size=VOCAB), "{prompt}\n", False)


@pytest.mark.parametrize("messages,message", [
    ([{"role": "user", "content": "hi"}], "has no assistant turn"),
    ([{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}],
     "got role 'tool'"),
])
def test_bad_conversations_are_refused(chat_tokenizer, messages, message):
    with pytest.raises(ConfigError, match=f"f:7: .*{message}"):
        render({"messages": messages}, "f:7", chat_tokenizer, "{prompt}\n", False)


def test_the_cli_refuses_what_sft_cannot_do(pairs, tmp_path):
    base = ["train", "--data", "sft", "--data-path", pairs, "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(VOCAB), "--seq-length", "32",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    for extra, message in (
            (["--sft-prompt-template", "{question}"], "may hold only {prompt}"),
            (["--reset-attention-mask"], "--data sft keeps documents apart itself"),
            (["--sft-pad-to-multiple-of", "5"], "must be a positive divisor of --seq-length 32"),
            (["--data-path", "0.5", pairs, "0.5", str(tmp_path / "no.jsonl")], "is not a file"),
            (["--data-path", str(tmp_path / "nope.jsonl")], "is not a file")):
        result = CliRunner().invoke(cli, [*base, *extra], catch_exceptions=False)
        assert result.exit_code == 2 and message in result.output, (extra, result.output)


def test_packing_is_refused_where_attention_cannot_keep_records_apart(pairs, monkeypatch):
    from plugtron.core.training.validate import validate
    from plugtron.plugins.layer_backends.te import TEBackend
    from plugtron.testing import make_config

    monkeypatch.setattr(TEBackend, "supports_document_ids", False)  # a backend that cannot

    with pytest.raises(ConfigError, match=r"--data sft with packing \(--no-sft-packing: one "
                                          r"record per sequence\) is not supported by "
                                          r"--layer-backend te"):
        validate(make_config(_flags(pairs, **{"layer-backend": "te"})), 1)


# --------------------------------------------------------------------------- training


MODELS = {
    "gpt": {},
    "rope-gqa": {"position-embedding-type": "rope", "num-query-groups": 2,
                 "normalization": "RMSNorm", "swiglu": True},
    "moe": {"num-experts": 4, "moe-router-topk": 2},
    "mla": {"multi-latent-attention": True, "q-lora-rank": 12, "kv-lora-rank": 8,
            "qk-head-dim": 6, "qk-pos-emb-head-dim": 4, "v-head-dim": 5,
            "position-embedding-type": "rope", "normalization": "RMSNorm"},
    # Mamba's conv window and state restart at each record (the scan is chunked: 8 < 13)
    "hybrid": {"model": "hybrid", "hybrid-layer-pattern": "M*M-", "mamba-chunk-size": 8,
               "mamba-state-dim": 8, "mamba-head-dim": 8, "mamba-num-groups": 2},
}


@pytest.mark.parametrize("model", list(MODELS))
def test_packed_and_one_record_per_sequence_train_alike(pairs, pool, model):
    """All 8 records in each global batch: 4 packs, or 8 single sequences; a pack's loss is
    its records' losses, each computed alone (positions restart, attention stays inside)."""
    flags = _flags(pairs, **MODELS[model], **{"train-iters": 2})
    packed = train_run({**flags, "global-batch-size": 4}, 1, pool)
    single = train_run({**flags, "global-batch-size": 8, "sft-packing": False}, 1, pool)
    for a, b in zip(packed.records, single.records):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


LAYOUTS = ({"tp": 2, "sequence-parallel": True}, {"pp": 2}, {"dp": 2})
#: Context parallelism: records cross the cp chunks; every comm type (attention models only:
#: Mamba layers refuse cp).
CP_LAYOUTS = tuple({"cp": 2, "cp-comm-type": comm} for comm in ("p2p", "allgather", "a2a"))


@pytest.mark.parametrize("model", ["gpt", "hybrid", "mla"])
def test_packed_layouts_train_like_one_process(pairs, pool, model):
    """GPT's records are padded to multiples of 2 x cp, so cp cuts each in parts (Megatron's THD
    split); MLA's are not, so cp cuts the sequence as a whole: both equal one process."""
    layouts = LAYOUTS + (CP_LAYOUTS if model != "hybrid" else ())
    padded = {"sft-pad-to-multiple-of": 4} if model == "gpt" else {}
    assert_layouts_match(_flags(pairs, **MODELS[model], **{"global-batch-size": 4}, **padded),
                         layouts=layouts if model != "mla" else CP_LAYOUTS, pool=pool)


#: The other layouts packed records must train under: vp, fsdp2, full recompute, ep (MoE).
MORE_LAYOUTS = {
    "vp": ("gpt", {"pp": 2, "vp": 2}),
    "fsdp2": ("gpt", {"dp": 2, "data-parallel": "fsdp2"}),
    "recompute": ("gpt", {"recompute-granularity": "full", "recompute-method": "uniform"}),
    "ep": ("moe", {"dp": 2, "expert-model-parallel-size": 2}),
}


@pytest.mark.parametrize("name", sorted(MORE_LAYOUTS))
def test_packed_records_under_vp_fsdp2_recompute_and_ep(pairs, pool, name):
    model, layout = MORE_LAYOUTS[name]
    flags = _flags(pairs, **MODELS[model], **{"global-batch-size": 4})
    if name == "vp":
        flags["num-layers"] = 4  # two chunks of two layers on each of the two stages
    assert_layouts_match(flags, layouts=[layout], pool=pool)


def test_multi_token_prediction_on_records_cut_in_parts_under_cp(pairs, pool):
    """MTP's shifted inputs cross the cp ranks in the per-record split: cp 2 equals one
    process."""
    flags = _flags(pairs, **{"global-batch-size": 4, "sft-pad-to-multiple-of": 4,
                             "mtp-num-layers": 2, "mtp-loss-scaling-factor": 0.3,
                             "position-embedding-type": "rope"})
    assert_layouts_match(flags, layouts=[{"cp": 2}], pool=pool)


def test_qk_clip_on_records_cut_in_parts_under_cp(pairs, pool):
    """QK-clip's logits under cp 2 go by each token's position in the per-record split, inside
    its record: the clipped steps equal one process's (Muon, fp32 Newton-Schulz)."""
    flags = _flags(pairs, **{"global-batch-size": 4, "sft-pad-to-multiple-of": 4,
                             "optimizer": "muon", "muon-fp32-matmul-prec": "high",
                             "qk-clip": True, "qk-clip-threshold": 0.01, "lr": 5e-3})
    assert_layouts_match(flags, layouts=[{"cp": 2}], pool=pool)


def test_records_padded_to_a_multiple_learn_the_same(pairs, pool):
    """Padding each record (after its last token, without loss) changes no loss or gradient:
    here the packs are the same two records either way (13 positions, padded to 16)."""
    flags = _flags(pairs, **{"global-batch-size": 4, "train-iters": 2})
    plain = train_run(flags, 1, pool)
    padded = train_run({**flags, "sft-pad-to-multiple-of": 16}, 1, pool)
    for a, b in zip(plain.records, padded.records):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_padding_lays_each_record_on_a_multiple():
    documents = [(np.arange(1, 7), np.ones(6)), (np.arange(10, 13), np.ones(3))]  # 5, 2 positions
    assert pack([6, 3], 16, "in-order", 10, multiple=4) == [[0, 1]]
    assert pack([6, 3], 11, "in-order", 10, multiple=4) == [[0], [1]]  # 8 + 4 > 11
    sample = packed_sample(documents, 16, True, multiple=4)
    assert sample["attention_mask"].tolist() == [0] * 8 + [1] * 4 + [2] * 4
    assert sample["position_ids"].tolist() == [*range(8), *range(4), *range(4)]
    assert sample["loss_mask"].tolist() == [1] * 5 + [0] * 3 + [1] * 2 + [0] * 6
    assert sample["labels"][:5].tolist() == [2, 3, 4, 5, 6]


def test_a_sample_depends_only_on_seed_split_and_index(pairs):
    from plugtron.plugins.datasets.sft import SFTPlugin
    from plugtron.testing import make_config

    config = make_config(_flags(pairs))
    short = SFTPlugin().dataset_provider(config=config, split_sizes=(4, 0, 0))[0]
    long = SFTPlugin().dataset_provider(config=config, split_sizes=(40, 0, 0))[0]
    assert len(short) == 4 and len(long) == 40  # ten epochs of the four packs
    for i in range(4):
        assert all(torch.equal(short[i][k], long[i][k]) for k in short[i])
    assert {tuple(long[i]["tokens"].tolist()) for i in range(4)} == \
        {tuple(long[i]["tokens"].tolist()) for i in range(4, 8)}  # the next epoch: reordered


def test_files_blended_by_weight_give_each_its_share(tmp_path):
    """``--data-path 0.25 A 0.75 B``: every prefix of the samples holds each file's share
    (Megatron's greedy blend), each file packed on its own; a sample depends only on the seed,
    the split and its index (a run drawing more samples draws the same first ones)."""
    from plugtron.plugins.datasets.sft import SFTPlugin
    from plugtron.testing import make_config

    a = _pairs(tmp_path / "a.jsonl", count=6, seed=1)
    b = _pairs(tmp_path / "b.jsonl", count=10, seed=2)
    tokens_of_a = {tuple(json.loads(line)["prompt"].split()) for line in open(a)}
    config = make_config(_flags(["0.25", a, "0.75", b]))
    short = SFTPlugin().dataset_provider(config=config, split_sizes=(8, 0, 0))[0]
    long = SFTPlugin().dataset_provider(config=config, split_sizes=(40, 0, 0))[0]
    assert len(long) == 40 and long.weights == [0.25, 0.75]

    def from_a(sample):  # a pack holds records of one file only
        first = tuple(str(t) for t in sample["tokens"][:9].tolist())
        return first in tokens_of_a

    picks = [from_a(long[i]) for i in range(40)]
    assert sum(picks[:8]) == 2 and sum(picks[:20]) == 5 and sum(picks) == 10
    for i in range(8):
        assert all(torch.equal(short[i][k], long[i][k]) for k in short[i])
    unweighted = SFTPlugin().dataset_provider(config=make_config(_flags([a, b])),
                                              split_sizes=(8, 0, 0))[0]
    assert len(unweighted.packs) == 8  # one pool of the 16 records, two to a pack


def test_data_stats_gives_each_file_its_records_and_packing(tmp_path):
    a = _pairs(tmp_path / "a.jsonl", count=6, seed=1)
    b = _pairs(tmp_path / "b.jsonl", count=10, seed=2)
    result = CliRunner().invoke(cli, ["data", "stats", "--data", "sft", "--data-path", "0.25",
                                      a, "0.75", b, "--tokenizer-type", "NullTokenizer",
                                      "--vocab-size", str(VOCAB), "--seq-length", "32",
                                      "--split", "100,0,0", "--train-iters", "10",
                                      "--global-batch-size", "4"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "train: 40 samples built, the run draws 40" in result.output
    assert (f"  {a}: weight 0.2500 (effective 0.2500, 10 drawn), 6 records (mean 14.0 tokens) "
            f"in 3 sequences, packing efficiency 81.2%") in result.output, result.output


def test_data_inspect_shows_each_record_and_what_it_learns(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text('{"prompt": "1 2 3", "response": "4 5"}\n{"prompt": "6", "response": "7"}\n')
    result = CliRunner().invoke(cli, ["data", "inspect", "--data", "sft", "--data-path",
                                      str(path), "--tokenizer-type", "NullTokenizer",
                                      "--vocab-size", str(VOCAB), "--seq-length", "16",
                                      "--split", "100,0,0", "--sft-packing-order", "in-order"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "sample 0: loss on 5 of 16 tokens, 3 document(s)" in lines
    # the records in their seeded order, each with the labels that carry loss, then padding
    assert "  document 0, positions 0-1: '6 7'" in lines
    assert "    loss on 2 token(s): '7 127'" in lines
    assert "  document 1, positions 2-6: '1 2 3 4 5'" in lines
    assert "    loss on 3 token(s): '4 5 127'" in lines
    assert "    loss on 0 token(s): ''" in lines


def test_a_run_resumed_mid_epoch_reads_and_learns_what_the_whole_run_did(tmp_path):
    """3 packs an epoch, 2 a step: the save after step 2 falls inside the second epoch. The
    resumed steps 3-5 have the uninterrupted run's losses bitwise (one process, fp32)."""
    path = _pairs(tmp_path / "r.jsonl", count=6)
    base = ["train", "--data", "sft", "--data-path", path, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB), "--seq-length", "32", "--split", "100,0,0",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "5",
            "--eval-interval", "0", "--no-progress", "--hidden-dropout", "0",
            "--attention-dropout", "0"]

    def run(*extra, name):
        metrics = tmp_path / f"{name}.jsonl"
        result = CliRunner().invoke(cli, [*base, *extra, "--metrics-file", str(metrics)],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return {r["iteration"]: r["lm_loss"] for r in map(json.loads, metrics.read_text()
                                                         .splitlines()) if "lm_loss" in r}

    whole = run(name="whole")
    save = str(tmp_path / "ckpt")
    run("--save", save, "--save-interval", "2", "--exit-interval", "2", name="first")
    resumed = run("--load", save, name="resumed")
    assert sorted(resumed) == [3, 4, 5]
    assert all(resumed[i] == whole[i] for i in resumed), (resumed, whole)


def test_parquet_records_read_like_jsonl(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    rows = [{"prompt": "1 2", "response": "3"}, {"prompt": "4", "response": "5 6"}]
    pq.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "r.parquet")
    got = list(read_records(str(tmp_path / "r.parquet")))
    assert [record for _, record in got] == rows
    assert got[1][0].endswith("r.parquet:row 2")
