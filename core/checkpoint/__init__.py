"""Checkpoints: the whole training state in safetensors + JSON, loadable into any layout.

The training loop calls four functions (core/training/loop.py):

* :func:`load_if_requested` after ``setup()``: ``--load``;
* :func:`after_step` after every iteration: ``--save-interval``;
* :func:`at_train_end` when the loop ends: the final ``--save`` and waiting for an async one;
* :func:`close` on the way out, also after an error: joins a background writer, commits nothing.

See docs/checkpoints.md for the format and the resharding rules.
"""

from __future__ import annotations

import os

from plugtron.core.checkpoint import layout
from plugtron.core.checkpoint.loader import load_base, load_checkpoint
from plugtron.core.checkpoint.reader import CheckpointReader
from plugtron.core.checkpoint.saver import Checkpointer
from plugtron.core.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "Checkpointer",
    "after_step",
    "at_train_end",
    "checkpointer",
    "close",
    "load_checkpoint",
    "load_if_requested",
]


def checkpointer(run) -> Checkpointer:
    if getattr(run, "checkpointer", None) is None:
        run.checkpointer = Checkpointer(run)
    return run.checkpointer


def load_if_requested(run, model_only: bool = False) -> None:
    """``--load DIR``: resume from it. With ``--load`` equal to ``--save`` and nothing saved
    yet, start from scratch (the usual restartable job script), or with ``--finetune`` from
    ``--pretrained-checkpoint``'s model weights; any other ``--load`` without a checkpoint is
    an error."""
    path = run.config.checkpoint.load
    resumed = False
    if path:
        same_as_save = (run.config.checkpoint.save is not None and
                        os.path.abspath(path) == os.path.abspath(run.config.checkpoint.save))
        if same_as_save and not layout.has_checkpoint(path):
            if run.config.checkpoint.exit_on_missing_checkpoint:
                raise CheckpointError(f"--exit-on-missing-checkpoint: --load {path} has no "
                                      f"checkpoint")
            if run.world.rank == 0 and not run.config.checkpoint.finetune:
                print(f"no checkpoint in {path} yet: starting from scratch", flush=True)
        else:
            load_checkpoint(run, path, model_only=model_only)
            resumed = True
            if not same_as_save and not model_only:
                _note_newer_in_save(run)
    if not resumed and run.config.checkpoint.finetune:
        load_base(run, run.config.checkpoint.pretrained_checkpoint)
        if run.world.rank == 0:
            print(f"fine-tuning from {run.base_checkpoint['path']} (iteration "
                  f"{run.base_checkpoint['iteration']}): its model weights, at iteration 0",
                  flush=True)
    checkpointer(run).start_iteration = run.state.iteration


def _note_newer_in_save(run) -> None:
    """As Megatron, ``--load`` is what resumes, even when ``--save`` (another directory) holds
    a newer checkpoint; say so, since a restarted job would redo that work and save over it."""
    save = run.config.checkpoint.save
    if not save or run.world.rank != 0:
        return
    newer = [it for it, _ in layout.complete_checkpoints(save) if it > run.state.iteration]
    if newer:
        print(f"note: --save {save} holds iteration {max(newer)}, newer than the loaded "
              f"{run.state.iteration}; as Megatron, --load {run.config.checkpoint.load} is what "
              f"resumes (give --load {save} to continue from there)", flush=True)


def after_step(run, iteration: int) -> None:
    c = run.config.checkpoint
    if c.save and c.save_interval and iteration % c.save_interval == 0:
        checkpointer(run).save(iteration)
    elif getattr(run, "checkpointer", None) is not None:
        run.checkpointer.poll()


def at_train_end(run) -> None:
    """Save the final state unless this iteration was just saved (or nothing was trained), then
    wait for the last write to be committed."""
    ckpt = checkpointer(run)
    if (run.config.checkpoint.save and run.state.iteration != ckpt.last_saved
            and run.state.iteration != ckpt.start_iteration):
        ckpt.save(run.state.iteration)
    ckpt.wait()


def close(run) -> None:
    ckpt = getattr(run, "checkpointer", None)
    if ckpt is not None:
        ckpt.abandon()
