"""plugtron's launcher relies on torchrun's public --signals-to-handle instead of patching
torch: with this torch it is used; a torch without it gets a clear one-line warning and torch's
own behaviour, not a crash. (The grace after a failed rank is plugtron's own: the frozen-rank
test in test_ranks_and_signals.py.)"""

from __future__ import annotations

import argparse

from plugtron.cli.launch import TORCHRUN_OPTIONS, torchrun_argv


def test_this_torch_has_the_options_plugtron_uses():
    argv, warning = torchrun_argv(2, "train", "c.json")
    assert warning is None
    for option, value in TORCHRUN_OPTIONS.items():
        assert f"{option}={value}" in argv
    from torch.distributed.run import parse_args

    args = parse_args(argv)
    assert args.signals_to_handle == "SIGQUIT"


def test_a_torch_without_them_degrades_with_a_warning():
    old = argparse.ArgumentParser()
    old.add_argument("--standalone", action="store_true")
    old.add_argument("--nproc-per-node")
    argv, warning = torchrun_argv(2, "train", "c.json", parser=old)
    assert not any(a.startswith(tuple(TORCHRUN_OPTIONS)) for a in argv)
    assert "--signals-to-handle" in warning and "without a save" in warning
