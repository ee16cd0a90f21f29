"""benchmarks/results.py: a benchmark's section replaces the one it wrote before."""

from __future__ import annotations

import importlib.util
import json
import pathlib

_SPEC = importlib.util.spec_from_file_location(
    "benchmark_results", pathlib.Path(__file__).parents[2] / "benchmarks" / "results.py")
results = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(results)


def test_a_section_replaces_its_earlier_run_and_a_new_one_is_appended(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\nintro\n\n## Foo (2026-01-01)\n\nold foo\n\n"
                    "## Bar — 2026-01-02\n\nold bar\n")
    results.write_section("## Foo (2026-12-03, later)\n\nnew foo\n", path)
    results.write_section("## Baz (2026-12-03)\n\nnew baz", path)
    assert path.read_text() == ("# Benchmark results\n\nintro\n\n## Foo (2026-12-03, later)\n\n"
                                "new foo\n\n## Bar — 2026-01-02\n\nold bar\n\n"
                                "## Baz (2026-12-03)\n\nnew baz\n")


def test_every_section_of_the_results_file_is_there_once():
    text = (pathlib.Path(__file__).parents[2] / "benchmarks" / "RESULTS.md").read_text()
    titles = [results._title(line) for line in text.splitlines() if line.startswith("## ")]
    assert len(titles) == len(set(titles)), sorted(t for t in titles if titles.count(t) > 1)


def test_metrics_rates_compares_runs_with_the_first(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "metrics_rates", pathlib.Path(__file__).parents[2] / "benchmarks" / "metrics_rates.py")
    rates = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rates)
    for name, step, losses in (("a", 0.5, [4.0, 3.0, 2.0, 1.0]), ("b", 0.25, [4.0, 3.0, 2.0, 1.1])):
        records = [{"iteration": i + 1, "lm_loss": x, "step_time_s": step}
                   for i, x in enumerate(losses)] + [{"summary": True}]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(map(json.dumps, records)))
    lines = rates.report(100, [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    assert lines[0].startswith("a           :        200 tokens/s (1.00x a)")
    assert "400 tokens/s (2.00x a), final loss 1.1000" in lines[1]
    assert lines[1].endswith("difference to a 1.00e-01")
