"""Checkpoints are untrusted input: every hostile variant of issue 13 (and a seeded fuzz of
manifests) is refused by every command that opens a checkpoint with exit 2 and a message, no
traceback, no file outside the checkpoint opened, no hang, no large allocation.

The commands run in one driver process (one torch import) under a memory cap; a few run as
real `plugtron` processes too. Files outside the checkpoint that a bad manifest names are a
valid copy of the weights (a leak would load, rc 0) and a FIFO (opening it would hang).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import pytest

from .mutate import (
    MANIFEST,
    MODEL,
    OPTIM,
    edit_manifest,
    first_tensor,
    refresh_metadata,
    rename_file,
)
from .tools import PYTHON, finish, run_cli, start_cli, tiny_flags

COMMANDS = ("inspect", "evaluate", "export", "train")


def _args(command: str, ckpt: str, work: str) -> list[str]:
    if command == "inspect":
        return ["checkpoint", "inspect", ckpt]
    if command == "evaluate":
        return ["evaluate", "--load", ckpt, "--eval-iters", "1", "--no-progress"]
    if command == "export":
        return ["convert", "export-hf", ckpt, os.path.join(work, "hf-out")]
    return ["train", *tiny_flags(train_iters=3), "--load", ckpt]


# --------------------------------------------------------------------------- hostile variants
def dotdot(ckpt, outside):
    edit_manifest(ckpt, lambda c: rename_file(c, MODEL, "../outside/" + MODEL))


def absolute(ckpt, outside):
    edit_manifest(ckpt, lambda c: rename_file(c, MODEL, os.path.join(outside, MODEL)))


def etc_hostname(ckpt, outside):
    edit_manifest(ckpt, lambda c: rename_file(c, MODEL, "/etc/hostname",
                                              {"crc32": "00000000", "bytes": 1}))


def symlink_out(ckpt, outside):
    os.remove(os.path.join(ckpt, MODEL))
    os.symlink(os.path.join(outside, MODEL), os.path.join(ckpt, MODEL))


def dev_zero(ckpt, outside):
    edit_manifest(ckpt, lambda c: rename_file(c, MODEL, "/dev/zero",
                                              {"crc32": "00000000", "bytes": 0}))


def symlink_dev_zero(ckpt, outside):
    os.remove(os.path.join(ckpt, MODEL))
    os.symlink("/dev/zero", os.path.join(ckpt, MODEL))
    edit_manifest(ckpt, lambda c: c["files"].__setitem__(MODEL, {"crc32": "00000000",
                                                                 "bytes": 0}))


def fifo_bytes0(ckpt, outside):
    os.remove(os.path.join(ckpt, MODEL))
    os.mkfifo(os.path.join(ckpt, MODEL))
    edit_manifest(ckpt, lambda c: c["files"].__setitem__(MODEL, {"crc32": "00000000",
                                                                 "bytes": 0}))


def dtype_int8(ckpt, outside):
    edit_manifest(ckpt, lambda c: first_tensor(c).__setitem__("dtype", "int8"))


def dtype_garbage(ckpt, outside):
    edit_manifest(ckpt, lambda c: first_tensor(c).__setitem__("dtype", "float33"))


def overlapping(ckpt, outside):
    def edit(c):
        rec = first_tensor(c)
        rows, cols = rec["global_shape"]
        rec["global_shape"] = [2 * rows, cols]
        rec["pieces"] = [dict(rec["pieces"][0]), dict(rec["pieces"][0])]  # both at row 0
    edit_manifest(ckpt, edit)


def huge_shape(ckpt, outside):
    edit_manifest(ckpt, lambda c: first_tensor(c).__setitem__("global_shape", [1 << 40, 1024]))


def bad_rng(ckpt, outside):
    edit_manifest(ckpt, lambda c: c["rng"].__setitem__(
        "torch", {"__tensor__": "uint8", "shape": [5056], "data": "AAAA"}))


def rng_not_dict(ckpt, outside):
    edit_manifest(ckpt, lambda c: c.__setitem__("rng", "not a state"))


def missing_key(ckpt, outside):
    edit_manifest(ckpt, lambda c: c.pop("tensors"))


def list_for_dict(ckpt, outside):
    edit_manifest(ckpt, lambda c: c.__setitem__("files", [MODEL, OPTIM]))


def string_version(ckpt, outside):
    refresh_metadata(ckpt, lambda m: m.__setitem__("version", "1"))


def manifests_list(ckpt, outside):
    refresh_metadata(ckpt, lambda m: m.__setitem__("manifests", [MANIFEST]))


def missing_iteration(ckpt, outside):
    refresh_metadata(ckpt, lambda m: m.pop("iteration"))


def manifest_dotdot(ckpt, outside):
    shutil.copy(os.path.join(ckpt, MANIFEST), os.path.join(outside, MANIFEST))
    refresh_metadata(ckpt, lambda m: m.__setitem__(
        "manifests", {"../outside/" + MANIFEST: m["manifests"][MANIFEST]}))


def optimizer_piece(ckpt, outside):
    edit_manifest(ckpt, lambda c: first_tensor(c, "optim/").__setitem__("dtype", "int8"))


def config_type(ckpt, outside):
    refresh_metadata(ckpt, lambda m: m["config"]["model"].__setitem__("hidden_size", "32"))


def _as_save_dir(ckpt, name="iter_0000002"):
    """Turn the checkpoint directory into a save directory holding it as ``name``."""
    inner = ckpt + ".inner"
    os.rename(ckpt, inner)
    os.makedirs(ckpt)
    os.rename(inner, os.path.join(ckpt, name))


def fifo_latest(ckpt, outside):
    _as_save_dir(ckpt)
    os.mkfifo(os.path.join(ckpt, "latest"))


def symlink_iter(ckpt, outside):
    """``iter_0000009 -> a complete checkpoint outside``, ``latest`` naming it."""
    shutil.copytree(ckpt, os.path.join(outside, os.path.basename(os.path.dirname(ckpt))))
    _as_save_dir(ckpt)
    os.symlink(os.path.join(outside, os.path.basename(os.path.dirname(ckpt))),
               os.path.join(ckpt, "iter_0000009"))
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("iter_0000009\n")


def duplicate_key(ckpt, outside):
    """Two pieces backed by one stored tensor: each half of a doubled tensor reads it."""
    def edit(c):
        rec = first_tensor(c)
        rows, cols = rec["global_shape"]
        rec["global_shape"] = [2 * rows, cols]
        rec["pieces"] = [dict(rec["pieces"][0]), {**rec["pieces"][0], "offset": [rows, 0]}]
    edit_manifest(ckpt, edit)


VARIANTS = [dotdot, absolute, etc_hostname, symlink_out, dev_zero, symlink_dev_zero,
            fifo_bytes0, dtype_int8, dtype_garbage, overlapping, huge_shape, bad_rng,
            rng_not_dict, missing_key, list_for_dict, string_version, manifests_list,
            missing_iteration, manifest_dotdot, optimizer_piece, config_type, fifo_latest,
            symlink_iter, duplicate_key]


#: Faults of the files themselves, not of a manifest field (their messages name the file only).
NOT_A_FIELD = {"fifo_latest", "symlink_iter", "overlapping", "duplicate_key"}


# --------------------------------------------------------------------------- fuzzed manifests
NASTY = [None, -1, 0, 2**70, 1.5, float("nan"), "x", "", "../x", "/dev/zero", [], {}, [1, -2],
         [[1]], True, {"a": 1}, "float33", [2**40, 2**40]]


def _paths(value, prefix=()):
    """Every (path, value) of a JSON tree, skipping the long base64 RNG blobs."""
    yield prefix, value
    if isinstance(value, dict):
        for k, v in value.items():
            if k != "data":
                yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:4]):
            yield from _paths(v, prefix + (i,))


def fuzz_case(seed: int):
    def mutate(ckpt, outside):
        rng = random.Random(seed)

        def edit(c):
            paths = [p for p, _ in _paths(c) if p and p[0] != "info"]
            for _ in range(rng.randint(1, 3)):
                path = rng.choice(paths)
                target = c
                for key in path[:-1]:
                    target = target[key]
                if isinstance(target, (dict, list)):
                    target[path[-1]] = rng.choice(NASTY)
                paths = [p for p, _ in _paths(c) if p and p[0] != "info"]
        edit_manifest(ckpt, edit)
    mutate.__name__ = f"fuzz{seed}"
    return mutate


FUZZ = [fuzz_case(seed) for seed in range(40)]


# --------------------------------------------------------------------------- the test
def _prepare(saved_ckpt, root, variants, commands):
    outside = os.path.join(root, "outside")
    os.makedirs(outside)
    shutil.copy(os.path.join(saved_ckpt, MODEL), os.path.join(outside, MODEL))
    os.mkfifo(os.path.join(outside, "fifo"))
    cases = []
    for variant in variants:
        for command in commands(variant):
            work = os.path.join(root, f"{variant.__name__}-{command}")
            ckpt = os.path.join(work, "ckpt")
            shutil.copytree(saved_ckpt, ckpt, symlinks=True)
            variant(ckpt, outside)
            cases.append({"name": f"{variant.__name__}/{command}",
                          "args": _args(command, ckpt, work)})
    return outside, cases


def _drive(root, cases, timeout=150):
    spec = os.path.join(root, "cases.json")
    report = os.path.join(root, "report.json")
    with open(spec, "w") as f:
        json.dump({"forbidden": [os.path.join(root, "outside"), "/etc/hostname", "/dev/zero"],
                   "cases": cases}, f)
    done = finish(start_cli([], argv=[PYTHON, "-m", "tests.reliability.hostile_driver", spec,
                                      report]), timeout)
    assert not done.timed_out, f"a hostile checkpoint made a command hang:\n{done.out[-3000:]}"
    assert done.rc == 0, done.out
    with open(report) as f:
        results = json.load(f)
    return results[:-1], results[-1]["max_rss_mb"]


def test_hostile_variants_refused_by_every_command(saved_run, tmp_path):
    root = str(tmp_path)
    outside, cases = _prepare(saved_run[1], root, VARIANTS, lambda v: COMMANDS)
    results, rss = _drive(root, cases)
    bad = [r for r in results if r["rc"] != 2 or r["traceback"] or r["outside"]
           or "Traceback" in r["output"]]
    assert not bad, "\n".join(f"{r['name']}: rc {r['rc']} outside {r['outside']}\n"
                              f"{r['traceback'] or r['output']}" for r in bad)
    for r in results:  # the message names the checkpoint file at fault, and the field
        variant, command = r["name"].split("/")
        assert "Error:" in r["output"], r
        assert os.path.join(root, f"{variant}-{command}", "ckpt") in r["output"], r
        if variant not in NOT_A_FIELD:
            assert "field" in r["output"], r
    size = os.path.getsize("/etc/hostname")
    for r in results:  # a refusal never describes a file outside the checkpoint
        if r["name"].startswith("etc_hostname/"):
            assert not re.search(rf"\b{size} bytes", r["output"]), r
    assert rss < 3000, f"peak memory {rss:.0f} MB"
    assert max(r["seconds"] for r in results) < 20


def test_fuzzed_manifests(saved_run, tmp_path):
    root = str(tmp_path)
    commands = lambda v: (("inspect", "evaluate")[int(v.__name__[4:]) % 2],)  # noqa: E731
    outside, cases = _prepare(saved_run[1], root, FUZZ, commands)
    results, rss = _drive(root, cases)
    bad = [r for r in results if r["rc"] not in (0, 2) or r["traceback"] or r["outside"]
           or "Traceback" in r["output"]]
    assert not bad, "\n".join(f"{r['name']}: rc {r['rc']} outside {r['outside']}\n"
                              f"{r['traceback'] or r['output']}" for r in bad)
    refused = sum(r["rc"] == 2 for r in results)
    assert refused >= len(results) * 0.8, [r["name"] for r in results if r["rc"] == 0]
    assert rss < 3000


@pytest.mark.parametrize("variant", [dev_zero, fifo_bytes0, symlink_out])
def test_real_process_refuses(saved_run, tmp_path, variant):
    """The same through the installed `plugtron` in a process of its own, bounded in time."""
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    shutil.copy(os.path.join(saved_run[1], MODEL), os.path.join(outside, MODEL))
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved_run[1], ckpt)
    variant(ckpt, outside)
    done = run_cli(["checkpoint", "inspect", ckpt], timeout=60)
    assert done.rc == 2 and not done.timed_out, done.out
    assert "Traceback" not in done.out and (MODEL in done.out or MANIFEST in done.out)


# --------------------------------------------------------------------------- convert import-hf
def _hf_case(hf_dir, root, name, edit):
    target = os.path.join(root, name)
    shutil.copytree(hf_dir, target)
    edit(target)
    return {"name": f"hf/{name}", "args": ["convert", "import-hf", target,
                                           os.path.join(root, name + "-out")]}


def _index(target, shard):
    os.rename(os.path.join(target, "model.safetensors"), os.path.join(target, "shard.bin"))
    with open(os.path.join(target, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"lm_head.weight": shard}}, f)


def _config(target, change):
    path = os.path.join(target, "config.json")
    with open(path) as f:
        config = json.load(f)
    config = change(config)
    with open(path, "w") as f:
        f.write(config if isinstance(config, str) else json.dumps(config))


def test_import_hf_hostile(hf_dir, tmp_path):
    root = str(tmp_path)
    outside = os.path.join(root, "outside")
    os.makedirs(outside)
    shutil.copy(os.path.join(hf_dir, "model.safetensors"), os.path.join(outside, "w.safetensors"))
    cases = [
        _hf_case(hf_dir, root, "index-dotdot", lambda t: _index(t, "../outside/w.safetensors")),
        _hf_case(hf_dir, root, "index-absolute",
                 lambda t: _index(t, os.path.join(outside, "w.safetensors"))),
        _hf_case(hf_dir, root, "index-dev-zero", lambda t: _index(t, "/dev/zero")),
        _hf_case(hf_dir, root, "vocab-5e7",
                 lambda t: _config(t, lambda c: {**c, "vocab_size": 50_000_000})),
        _hf_case(hf_dir, root, "config-not-json", lambda t: _config(t, lambda c: "{oops")),
        _hf_case(hf_dir, root, "config-list", lambda t: _config(t, lambda c: [c])),
        _hf_case(hf_dir, root, "config-no-hidden",
                 lambda t: _config(t, lambda c: {k: v for k, v in c.items()
                                                 if k not in ("hidden_size", "n_embd")})),
        _hf_case(hf_dir, root, "config-string-layers",
                 lambda t: _config(t, lambda c: {**c, "num_hidden_layers": "two",
                                                 "n_layer": "two"})),
    ]
    # `train --load HF_DIR` reads the same directory through its own path (hf_load).
    for name, edit in [("index-dotdot", lambda t: _index(t, "../outside/w.safetensors")),
                       ("index-absolute",
                        lambda t: _index(t, os.path.join(outside, "w.safetensors"))),
                       ("symlink-out", lambda t: _symlink_weights(t, outside))]:
        case = _hf_case(hf_dir, root, "train-" + name, edit)
        case["args"] = ["train", *tiny_flags(train_iters=1), "--load", case["args"][2]]
        cases.append(case)
    cases += _megatron_cases(root, outside)
    # Controls: the untouched directories load, so each refusal above is the hostile edit's.
    cases += [{"name": "control/train-hf", "args": ["train", *tiny_flags(train_iters=1),
                                                    "--load", hf_dir]},
              {"name": "control/megatron", "args": ["convert", "import-megatron",
                                                    os.path.join(root, "mcore-clean", "mcore"),
                                                    os.path.join(root, "mcore-clean-out")]}]
    results, rss = _drive(root, cases)
    controls = [r for r in results if r["name"].startswith("control/")]
    assert all(r["rc"] == 0 for r in controls), controls
    results = [r for r in results if not r["name"].startswith("control/")]
    for r in results:
        if r["name"].startswith("hf/train-"):
            assert "safetensors" in r["output"], r
        if r["name"] == "megatron/overlapping":
            assert "overlap" in r["output"], r
        elif r["name"].startswith("megatron/"):
            assert ".distcp" in r["output"], r
    bad = [r for r in results if r["rc"] != 2 or r["traceback"] or r["outside"]
           or "Traceback" in r["output"]]
    assert not bad, "\n".join(f"{r['name']}: rc {r['rc']} outside {r['outside']}\n"
                              f"{r['traceback'] or r['output']}" for r in bad)
    assert rss < 3000


def _symlink_weights(target, outside):
    os.remove(os.path.join(target, "model.safetensors"))
    os.symlink(os.path.join(outside, "w.safetensors"), os.path.join(target, "model.safetensors"))


# --------------------------------------------------------------------------- Megatron torch_dist
def _megatron_cases(root, outside):
    """Hostile variants of a Megatron-Core torch_dist checkpoint for `convert import-megatron`:
    a chunk stored under `../`, an absolute path, a shard file that is a symlink leaving the
    directory (each target a valid copy, so a leak would import), two chunks at one offset."""
    import pickle

    from gpt_plugin.tests.test_megatron_convert import _fixture

    clean = _fixture(types_path(root, "mcore-clean"))
    parent = os.path.dirname(clean)
    shard = next(n for n in os.listdir(clean) if n.endswith(".distcp"))
    shutil.copy(os.path.join(clean, shard), os.path.join(outside, shard))

    def metadata(directory, edit):
        path = os.path.join(directory, ".metadata")
        with open(path, "rb") as f:
            meta = pickle.load(f)  # the test's own file: trusted here
        edit(meta)
        with open(path, "wb") as f:
            pickle.dump(meta, f)

    def relocate(where):
        def edit(meta):
            for info in meta.storage_data.values():
                info.relative_path = where
        return lambda d: metadata(d, edit)

    def overlap(meta):
        chunks = next(m.chunks for m in meta.state_dict_metadata.values()
                      if hasattr(m, "chunks") and len(m.chunks) == 1 and len(m.size) == 2)
        first = chunks[0]
        rows = first.sizes[0]
        meta_size = type(first.sizes)([rows, first.sizes[1]])
        chunks.append(type(first)(offsets=type(first.offsets)([0, 0]), sizes=meta_size))
        for m in meta.state_dict_metadata.values():
            if getattr(m, "chunks", None) is chunks:
                m.size = type(m.size)([2 * rows, m.size[1]])

    def symlink(d):
        os.remove(os.path.join(d, shard))
        os.symlink(os.path.join(outside, shard), os.path.join(d, shard))

    variants = {"dotdot": relocate("../../outside/" + shard),
                "absolute": relocate(os.path.join(outside, shard)),
                "symlink-out": symlink,
                "overlapping": lambda d: metadata(d, overlap)}
    cases = []
    for name, edit in variants.items():
        target = os.path.join(root, f"mcore-{name}")
        shutil.copytree(parent, target, symlinks=True)
        edit(os.path.join(target, os.path.basename(clean)))
        cases.append({"name": f"megatron/{name}",
                      "args": ["convert", "import-megatron", target,
                               os.path.join(root, f"mcore-{name}-out")]})
    return cases


def types_path(root, name):
    """A pathlib path (the fixture's tmp_path) under ``root``."""
    import pathlib

    path = pathlib.Path(root) / name
    path.mkdir()
    return path
