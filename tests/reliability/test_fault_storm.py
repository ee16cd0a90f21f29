"""The short version of benchmarks/fault_soak.py: one dp 2 x pp 2 job of a few dozen
iterations survives a SIGKILLed rank, a full disk during a save (torch elastic restarts the
group for both), and a SIGTERM of the whole job followed by a corrupted newest checkpoint (a
new job resumes from the checkpoint before it), and ends bitwise equal to a run that was
never interrupted: every model and optimizer tensor of the final checkpoint, and the final
loss."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "fault_soak.py"


def _soak():
    spec = importlib.util.spec_from_file_location("fault_soak", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fault_soak"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_short_storm_of_faults_loses_nothing(tmp_path):
    soak = _soak()
    report = soak.storm(str(tmp_path), iterations=30, seed=3,
                        kinds=("kill", "disk_full", "corrupt"), save_interval=5,
                        max_minutes=8)
    text = "\n".join(soak.describe(report))
    assert [f.kind for f in report.faults] and len(report.faults) == 3, text
    assert report.elastic_restarts >= 2 and report.jobs == 2, text  # kill, disk; corrupt
    assert report.recomputed > 0, text
    assert report.equal, text
