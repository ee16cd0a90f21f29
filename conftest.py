"""Suite-wide ordering: the test files that cost most start first.

`make test` hands whole files to two xdist workers (``--dist loadfile``) in collection order, so
a long file collected last keeps one worker busy after the other has run out of work (about 5
minutes of one idle core on 2026-12-04). Starting the longest files first lets the short ones
fill in at the end. The list is what `python benchmarks/suite_costs.py` printed for the last
full run, longest first; a file missing from it keeps its place after them. Order only: no test
depends on another, so this changes nothing but the wall time."""

from __future__ import annotations

HEAVIEST_FIRST = (
    "tests/cli/test_plugin_new.py",
    "tests/reliability/test_ranks_and_signals.py",
    "tests/reliability/test_save_directory.py",
    "tests/distributed/test_zero_bubble.py",
    "tests/reliability/test_two_nodes.py",
    "tests/reliability/test_elastic_nodes.py",
    "tests/distributed/test_fsdp2.py",
    "tests/reliability/test_elastic_restart.py",
    "tests/reliability/test_fault_storm.py",
    "moe_plugin/tests/test_moe_expert_parallel.py",
    "tests/cli/test_end_to_end.py",
    "tests/distributed/test_tensor_parallel.py",
    "tests/kit/test_testing_kit.py",
    "tests/distributed/test_context_parallel_training.py",
    "tests/reliability/test_preflight.py",
    "tests/distributed/test_pipeline.py",
    "moe_plugin/tests/test_deepseek_8_ranks.py",
    "gpt_plugin/tests/test_mtp_layouts.py",
    "tests/core/checkpoint/test_reshard.py",
    "tests/reliability/test_hostile_checkpoints.py",
    "gpt_plugin/tests/test_hybrid_layouts.py",
    "tests/distributed/test_recompute_layouts.py",
    "tests/core/tools/test_generate.py",
    "tests/core/tools/test_memory_estimate.py",
    "tests/reliability/test_slurm.py",
    "gpt_plugin/tests/test_mla_layouts.py",
    "moe_plugin/tests/test_moe_context_parallel.py",
    "tests/core/training/test_rerun.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
    # sorted() is stable: within a file, and among the files not listed, the order stays.
    items[:] = sorted(items, key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
