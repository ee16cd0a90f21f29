"""In-process checks of the mechanisms the fault tests rely on, without a run: the
tiling check (O(n log n), its refusals), a 65,536-piece manifest answered in bounded time, the
``latest`` pointer read safely, symlinked iteration directories refused, the atomic exchange of
a re-save, the metrics file writing NaN/Inf as null, and the second-SIGINT rule."""

from __future__ import annotations

import json
import math
import os
import threading
import time
import types

import pytest
import torch
from plugtron.core.checkpoint import layout, schema, writer
from plugtron.core.checkpoint.pieces import Box, Piece
from plugtron.core.checkpoint.reader import FORMAT, VERSION, CheckpointReader
from plugtron.core.errors import CheckpointError
from plugtron.core.monitoring.metrics import MetricsLogger


def _p(offset, shape):
    return Piece("f", "k", tuple(offset), tuple(shape))


def test_tiling_accepts_exact_and_names_overlap_gap_outside():
    rows = [_p((r, 0), (1, 4)) for r in range(8)]
    schema.check_tiling("t", (8, 4), rows, "m.json")  # row split
    grid = [_p((r, c), (2, 2)) for r in (0, 2) for c in (0, 2)]
    schema.check_tiling("t", (4, 4), grid, "m.json")  # 2-d grid
    pinwheel = [_p((0, 0), (2, 1)), _p((0, 1), (1, 2)), _p((1, 1), (1, 1)), _p((2, 0), (1, 2)),
                _p((1, 2), (2, 1))]  # no straight cut through it: not a product grid
    schema.check_tiling("t", (3, 3), pinwheel, "m.json")
    with pytest.raises(CheckpointError, match=r"m.json: tensor 't' \(field tensors\['t'\]"
                                              r"\.pieces\): pieces at \(0, 0\) and \(0, 2\) "
                                              r"overlap"):
        schema.check_tiling("t", (4, 4), [_p((0, 0), (4, 3)), _p((0, 2), (4, 1))], "m.json")
    with pytest.raises(CheckpointError, match="hold 12 elements"):
        schema.check_tiling("t", (4, 4), [_p((0, 0), (4, 3))], "m.json")
    with pytest.raises(CheckpointError, match="lies outside the global shape"):
        schema.check_tiling("t", (4, 4), [_p((2, 0), (4, 4))], "m.json")
    # Equal totals, yet one piece counted twice over a gap: named as an overlap.
    with pytest.raises(CheckpointError, match="overlap"):
        schema.check_tiling("t", (2, 2), [_p((0, 0), (1, 2)), _p((0, 0), (1, 2))], "m.json")


def test_tiling_refuses_a_grid_too_fine():
    # 2,100 staggered strips cutting both dimensions: 2,100 x 2,100 cells > the bound.
    n = 2100
    pieces = [_p((i, 0), (1, i + 1)) for i in range(n)] + \
             [_p((i, i + 1), (1, n - i - 1)) for i in range(n - 1)]
    with pytest.raises(CheckpointError, match="cells, more than"):
        schema.check_tiling("t", (n, n), pieces, "m.json")


def _write_many(directory: str, n: int, overlap: bool = False) -> None:
    """A one-tensor checkpoint of ``n`` one-element pieces (the schema's limit is 65,536)."""
    data = torch.arange(n, dtype=torch.float32).reshape(n, 1)
    boxes = [(Box((i - (1 if overlap and i == n - 1 else 0), 0), (1, 1), (0, 0)), data[i:i + 1])
             for i in range(n)]
    entry = writer.TensorEntry("model/w", (n, 1), boxes)
    writer.write_single(directory, [entry], {"format": FORMAT, "version": VERSION,
                                             "iteration": 0})


@pytest.mark.parametrize("overlap", [False, True])
def test_65536_pieces_answered_in_bounded_time(tmp_path, overlap):
    ckpt = str(tmp_path / "ckpt")
    _write_many(ckpt, 65536, overlap)
    start = time.monotonic()
    if overlap:
        with pytest.raises(CheckpointError, match="overlap"):
            CheckpointReader(ckpt)
    else:
        reader = CheckpointReader(ckpt)  # every piece checked against the header, tiling too
    took = time.monotonic() - start
    if not overlap:
        assert reader.tensors["model/w"].pieces[-1].offset == (65535, 0)
    print(f"65,536 pieces, overlap={overlap}: {took:.2f} s")
    assert took < 60  # a hang bound (the pairwise check took about 2 h), not a benchmark


def test_fifo_latest_is_refused_not_waited_on(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _write_many(ckpt, 4)
    save = str(tmp_path / "save")
    os.makedirs(save)
    os.rename(ckpt, os.path.join(save, "iter_0000001"))
    os.mkfifo(os.path.join(save, "latest"))
    answer = []
    worker = threading.Thread(target=lambda: answer.append(_refusal(save)), daemon=True)
    worker.start()
    worker.join(20)
    assert answer and "not a regular file" in answer[0], answer


def _refusal(save):
    try:
        layout.load_candidates(save)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_symlinked_iteration_directory_is_refused(tmp_path):
    elsewhere = str(tmp_path / "elsewhere")
    _write_many(elsewhere, 4)
    save = str(tmp_path / "save")
    os.makedirs(save)
    os.symlink(elsewhere, os.path.join(save, "iter_0000009"))
    writer.write_latest(save, "iter_0000009")
    with pytest.raises(CheckpointError, match="iter_0000009 is a symbolic link"):
        CheckpointReader(save)
    assert layout.complete_checkpoints(save) == []


def test_resave_exchanges_directories_atomically(tmp_path):
    """Both directories exist at every instant (renameat2 RENAME_EXCHANGE); skipped where the
    file system cannot exchange (the two-rename path is tested with a kill elsewhere)."""
    a, b = tmp_path / "new", tmp_path / "final"
    a.mkdir()
    b.mkdir()
    (a / "which").write_text("new")
    (b / "which").write_text("old")
    if not writer.exchange_dirs(str(a), str(b)):
        pytest.skip("no atomic exchange here")
    assert (b / "which").read_text() == "new" and (a / "which").read_text() == "old"


def test_metrics_logger_writes_nan_and_inf_as_null(tmp_path):
    path = tmp_path / "m.jsonl"
    config = types.SimpleNamespace(logging=types.SimpleNamespace(metrics_file=str(path),
                                                                 progress=False))
    logger = MetricsLogger(config, rank=0)
    logger.write({"iteration": 1, "lm_loss": math.nan, "grad_norm": math.inf,
                  "lr": -math.inf, "loss_scale": 2.0})
    logger.file.close()
    text = path.read_text()
    record = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert record["lm_loss"] is None and record["grad_norm"] is None and record["lr"] is None
    assert record["loss_scale"] == 2.0 and record["run_id"] == logger.run_id


def test_a_second_sigint_within_a_second_is_the_same_stop():
    import signal

    from plugtron.core.training.preemption import ABORT_AFTER_S, is_abort

    now = time.monotonic()
    assert not is_abort(signal.SIGINT, now)  # direct + forwarded copy of one stop
    assert is_abort(signal.SIGINT, now - ABORT_AFTER_S - 0.1)  # Ctrl-C again: abort
    assert not is_abort(signal.SIGTERM, now - 10)  # only SIGINT aborts


def test_a_new_run_in_the_same_process_forgets_the_last_ones_stop(monkeypatch):
    """A notebook's second run (or a test pool rank's): the earlier stop, and the signal that
    caused it, are forgotten when pretrain starts; a signal not yet acted on is kept."""
    import signal

    from plugtron.core.training import preemption

    monkeypatch.setattr(preemption, "_received", None)
    monkeypatch.setattr(preemption, "stopped", ("stopped after iteration 2: --exit-interval 2", 0))
    preemption.begin_run()
    assert preemption.stopped is None
    preemption.request_stop(signal.SIGTERM)  # arrives while the next run sets up: kept
    preemption.begin_run()
    assert preemption._received == signal.SIGTERM
    monkeypatch.setattr(preemption, "stopped", ("stopped by SIGTERM after iteration 3", 143))
    preemption.begin_run()  # that signal stopped a run: consumed
    assert preemption._received is None and preemption.stopped is None
