"""Data pipeline figures, side by side with Megatron-Core where it has the same piece.

* preprocess throughput (documents/s, tokens/s) with 1 and 2 worker processes (ByteTokenizer,
  a synthetic JSONL), alternating rounds;
* index build (document, sample and shuffle index of one split) for synthetic corpora of 10M and
  1B tokens written directly in the indexed format (uint16; the 1B corpus' .bin is a sparse file:
  an index build reads only the .idx) against Megatron-Core's ``_build_document_index`` +
  ``helpers_cpp.build_sample_idx`` + ``_build_shuffle_index``: seconds and peak memory, each in a
  fresh process (peak = VmHWM - VmRSS before the call);
* blending indices against ``helpers_cpp.build_blending_indices``;
* the index build at 10M tokens and both blends again in one process, alternating after a warm-up
  call of each (the steady state);
* random sample access (one sample's tokens from a memory-mapped corpus, and plugtron's whole
  sample with labels and masks) against Megatron-Core's ``IndexedDataset.get``.

    flock /tmp/plugtron-tests.lock .venv/bin/python benchmarks/bench_data.py [--big-tokens 1e9]
        [--only blend [--blend-sizes 10000000]]

``--only blend`` runs the blending rows alone (each fresh child imports Megatron-Core, seconds on
a loaded machine, so the whole script does not fit a short hold of the shared test lock).

Fresh processes are compared like with like: both sides' children import the same modules
(plugtron's index builder and, when installed, Megatron-Core's) before the timer, and before every
timed child an identical primer child touches and frees 256 MB. Why the primer: numpy asks for
transparent huge pages for large arrays, and on this VM a huge-page fault costs ~1 ms when the
kernel hands back 2 MB pages a previous process just freed, but ~7 ms when it needs fresh ones, so
without it the first child after a light one paid ~0.3 s more whichever side it was (measured,
RESULTS.md). Each fresh row also reports the timed call's minor faults and huge-page faults.

Corpora go to a temporary folder deleted at the end. Megatron-Core is optional (its columns
are skipped without it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SEQ = 2048
MEAN_DOC = 600


def have_megatron() -> bool:
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except Exception:
        return False
    return True


def write_corpus(prefix: str, num_tokens: int, real: bool, seed: int = 0) -> None:
    from plugtron.plugins.datasets.indexed_format import bin_path, idx_path, write_index

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2 * MEAN_DOC, size=int(num_tokens / MEAN_DOC * 1.1) + 10,
                           dtype=np.int32)
    ends = np.cumsum(lengths, dtype=np.int64)
    count = int(np.searchsorted(ends, num_tokens)) + 1
    lengths = lengths[:count]
    lengths[-1] -= int(ends[count - 1] - num_tokens)
    with open(bin_path(prefix), "wb") as f:
        if real:
            for start in range(0, num_tokens, 1 << 24):
                n = min(1 << 24, num_tokens - start)
                f.write(rng.integers(0, 50000, size=n, dtype=np.uint16).tobytes())
        else:
            f.truncate(num_tokens * 2)
    write_index(idx_path(prefix), np.uint16, lengths, np.arange(count + 1, dtype=np.int64))


def _rss(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def faults() -> tuple[int, int]:
    """(minor page faults of this process, huge-page faults of the whole machine so far)."""
    import resource

    thp = 0
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("thp_fault_alloc "):
                thp = int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt, thp


def import_both() -> None:
    """Both sides' children import the same modules before their timers, so neither pays for
    an import the other had already paid, and both start from the same heap."""
    from plugtron.plugins.datasets import gpt_indices

    gpt_indices._helpers()  # the compiled helper loaded once, as megatron's is at import
    if have_megatron():
        from megatron.core.datasets import (  # noqa: F401
            gpt_dataset,  # noqa: F401
            helpers,
            helpers_cpp,
        )


def child_prime(megabytes: int) -> dict:
    """Touch and free new memory, so that the next child finds the same supply of free
    (huge) pages whichever child ran before it."""
    np.ones(megabytes << 17, dtype=np.float64).sum()
    return {}


def child_index(impl: str, prefix: str, seed: int) -> dict:
    """One split's indices for one epoch of the whole corpus (in this fresh process)."""
    from plugtron.plugins.datasets.indexed_format import IndexedCorpus

    sizes = np.array(IndexedCorpus(prefix).sequence_lengths, dtype=np.int32)
    documents = np.arange(len(sizes), dtype=np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    num_samples = (tokens - 1) // SEQ
    import_both()
    if impl == "megatron":
        from megatron.core.datasets import helpers
        from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index
    from plugtron.plugins.datasets import gpt_indices

    before = _rss("VmRSS")
    faults_before = faults()
    start = time.perf_counter()
    if impl == "plugtron":
        arrays = gpt_indices.build_gpt_indices(sizes, documents, SEQ, num_samples, seed)
    else:
        rng = np.random.RandomState(seed)
        document_index = _build_document_index(documents, 1, rng, False)
        sample_index = helpers.build_sample_idx(sizes, document_index, SEQ, 1, tokens, True, 1)
        shuffle_index = _build_shuffle_index(sample_index.shape[0] - 1,
                                             sample_index.shape[0] - 1, rng)
        arrays = (document_index, sample_index, shuffle_index)
    seconds = time.perf_counter() - start
    minor, thp = (b - a for a, b in zip(faults_before, faults()))
    peak = _rss("VmHWM") - before
    digest = [int(np.asarray(a, dtype=np.int64).sum()) for a in arrays]
    return {"seconds": seconds, "peak_mb": peak, "digest": digest, "samples": num_samples,
            "documents": len(sizes), "minor_faults": minor, "thp_faults": thp}


def child_blend(impl: str, size: int) -> dict:
    weights = [0.2, 0.5, 0.3]
    if impl == "plugtron-python":
        os.environ["PLUGTRON_NO_INDEX_HELPERS"] = "1"
    import_both()
    if impl == "megatron":
        from megatron.core.datasets import helpers_cpp
    else:
        from plugtron.plugins.datasets import gpt_indices
    faults_before = faults()
    start = time.perf_counter()  # imports done: the build alone
    if impl == "megatron":
        d = np.zeros(size, dtype=np.int16)
        s = np.zeros(size, dtype=np.int64)
        helpers_cpp.build_blending_indices(d, s, np.array(weights), len(weights), size, False)
    else:
        d, s = gpt_indices.build_blending_indices(weights, size)
    seconds = time.perf_counter() - start
    minor, thp = (b - a for a, b in zip(faults_before, faults()))
    return {"seconds": seconds, "digest": [int(d.sum()), int(s.sum())], "minor_faults": minor,
            "thp_faults": thp}


def in_child(*args) -> dict:
    """One timed fresh process, after the same primer process (see the module docstring)."""
    _run_child("prime", "-", 256)
    return _run_child(*args)


def _run_child(*args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *map(str, args)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def rounds(impls, rounds_n, run) -> dict:
    """Alternating rounds: {impl: [results]}."""
    results = {impl: [] for impl in impls}
    for r in range(rounds_n):
        order = impls if r % 2 == 0 else list(reversed(impls))
        for impl in order:
            results[impl].append(run(impl))
    return results


def warm(impls, rounds_n, run) -> dict:
    """The same work in this process, after one untimed call of each side: the steady state,
    without the fresh process's first touch of new memory and lazy imports, which differ with
    what each side imported before (Megatron-Core's import leaves a large warm heap)."""
    for impl in impls:
        run(impl)
    got = rounds(impls, rounds_n, run)
    return {impl: median([r["seconds"] for r in rs]) for impl, rs in got.items()}


def median(values):
    return statistics.median(values)


def bench_preprocess(folder: str, docs: int) -> dict:
    from plugtron.plugins.datasets.preprocess import preprocess

    rng = np.random.default_rng(0)
    words = ["data", "model", "token", "train", "plugtron", "megatron", "layer", "the", "a"]
    path = os.path.join(folder, "corpus.jsonl")
    with open(path, "w") as f:
        for _ in range(docs):
            n = int(rng.integers(50, 250))
            f.write(json.dumps({"text": " ".join(rng.choice(words, n))}) + "\n")

    def run(workers):
        summary = preprocess([path], os.path.join(folder, f"pre{workers}"), "ByteTokenizer",
                             workers=workers, append_eod=True, progress=False,
                             log=lambda m: None)
        return summary.as_dict()

    results = rounds([1, 2], 3, run)
    return {w: {"documents_per_sec": median([r["documents_per_sec"] for r in rs]),
                "tokens_per_sec": median([r["tokens_per_sec"] for r in rs]),
                "tokens": rs[0]["tokens"], "documents": rs[0]["documents"]}
            for w, rs in results.items()}


def bench_access(prefix: str, count: int = 20000) -> dict:
    from plugtron.plugins.datasets import gpt_indices
    from plugtron.plugins.datasets.gpt_dataset import GPTIndexedDataset, Tokens
    from plugtron.plugins.datasets.indexed_format import IndexedCorpus

    corpus = IndexedCorpus(prefix)
    sizes = np.asarray(corpus.sequence_lengths)
    rng = np.random.default_rng(1)
    docs = rng.integers(0, len(sizes), size=count)
    offsets = (rng.random(count) * np.maximum(sizes[docs] - 64, 1)).astype(np.int64)

    def corpus_get(get):
        start = time.perf_counter()
        for d, o in zip(docs.tolist(), offsets.tolist()):
            np.array(get(d, o, 64))
        return (time.perf_counter() - start) / count * 1e6

    impls = {"plugtron": lambda: corpus_get(corpus.get)}
    if have_megatron():
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        theirs = IndexedDataset(prefix, mmap=True)
        impls["megatron"] = lambda: corpus_get(lambda d, o, n: theirs.get(d, offset=o, length=n))
    got = rounds(list(impls), 3, lambda impl: impls[impl]())
    out = {f"{impl}_get_us": median(v) for impl, v in got.items()}

    class Tok:
        eod, vocab_size, pad, eos, bos = 0, 65536, None, 0, None

    arrays = gpt_indices.build_gpt_indices(sizes.astype(np.int32),
                                           np.arange(len(sizes), dtype=np.int32), SEQ, None, 0)
    dataset = GPTIndexedDataset(corpus, dict(zip(("document_index", "sample_index",
                                                  "shuffle_index"), arrays)), "train",
                                Tokens(Tok()), None, {"range": [0, len(sizes)]})
    picks = rng.integers(0, len(dataset), size=2000).tolist()
    start = time.perf_counter()
    for i in picks:
        dataset[i]
    out["plugtron_sample_us"] = (time.perf_counter() - start) / len(picks) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs="*")
    parser.add_argument("--big-tokens", type=float, default=1e9)
    parser.add_argument("--preprocess-docs", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("all", "blend"), default="all")
    parser.add_argument("--blend-sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    args = parser.parse_args()
    if args.child:
        kind, impl, *rest = args.child
        result = (child_index(impl, rest[0], int(rest[1])) if kind == "index"
                  else child_prime(int(rest[0])) if kind == "prime"
                  else child_blend(impl, int(rest[0])))
        print(json.dumps(result))
        return
    mcore = have_megatron()
    folder = tempfile.mkdtemp(prefix="plugtron-bench-data-")
    report = {"megatron_core": mcore, "seq_length": SEQ, "mean_document": MEAN_DOC}
    try:
        impls = ["plugtron", "megatron"] if mcore else ["plugtron"]
        if args.only == "all":
            report["preprocess"] = bench_preprocess(folder, args.preprocess_docs)
            print(json.dumps({"preprocess": report["preprocess"]}), flush=True)
        corpora = (("10M", 10_000_000, True),
                   (f"{args.big_tokens:.0e}", int(args.big_tokens), False))
        for name, tokens, real in corpora if args.only == "all" else ():
            prefix = os.path.join(folder, f"c{name}")
            write_corpus(prefix, tokens, real)
            got = rounds(impls, args.rounds, lambda impl: in_child("index", impl, prefix, 1234))
            digests = {impl: rs[0]["digest"] for impl, rs in got.items()}
            entry = {impl: {"seconds": median([r["seconds"] for r in rs]),
                            "peak_mb": median([r["peak_mb"] for r in rs]),
                            "minor_faults": median([r["minor_faults"] for r in rs]),
                            "thp_faults": median([r["thp_faults"] for r in rs])}
                     for impl, rs in got.items()}
            entry["documents"], entry["samples"] = got["plugtron"][0]["documents"], \
                got["plugtron"][0]["samples"]
            if mcore:
                entry["same_arrays"] = digests["plugtron"] == digests["megatron"]
                entry["ratio_plugtron_over_megatron"] = (entry["plugtron"]["seconds"]
                                                         / entry["megatron"]["seconds"])
            if real and mcore:
                entry["warm"] = warm(impls, max(args.rounds, 5),
                                     lambda impl: child_index(impl, prefix, 1234))
                entry["warm"]["ratio_plugtron_over_megatron"] = (entry["warm"]["plugtron"]
                                                                 / entry["warm"]["megatron"])
            report[f"index_{name}"] = entry
            print(json.dumps({f"index_{name}": entry}), flush=True)
            if real:
                report["access_10M"] = bench_access(prefix)
                print(json.dumps({"access_10M": report["access_10M"]}), flush=True)
            os.remove(prefix + ".bin")
        for size in args.blend_sizes:
            blend_impls = impls + (["plugtron-python"] if size <= 1_000_000 else [])
            got = rounds(blend_impls, args.rounds, lambda impl: in_child("blend", impl, size))
            entry = {impl: median([r["seconds"] for r in rs]) for impl, rs in got.items()}
            entry["faults"] = {impl: [median([r["minor_faults"] for r in rs]),
                                      median([r["thp_faults"] for r in rs])]
                               for impl, rs in got.items()}
            entry["all_seconds"] = {impl: [round(r["seconds"], 4) for r in rs]
                                    for impl, rs in got.items()}
            if mcore:
                entry["same_arrays"] = got["plugtron"][0]["digest"] == got["megatron"][0]["digest"]
                entry["ratio_plugtron_over_megatron"] = entry["plugtron"] / entry["megatron"]
            if mcore:
                entry["warm"] = warm(impls, max(args.rounds, 5),
                                     lambda impl: child_blend(impl, size))
                entry["warm"]["ratio_plugtron_over_megatron"] = (entry["warm"]["plugtron"]
                                                                 / entry["warm"]["megatron"])
            report[f"blend_{size}"] = entry
            print(json.dumps({f"blend_{size}": entry}), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
