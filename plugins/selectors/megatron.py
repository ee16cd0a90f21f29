"""Selector ``megatron``: the flags with which Megatron-LM picks a pipeline schedule, an
optimizer and a data-parallel wrapper, answered with plugtron's built-in plugins.

* ``--schedule auto``: no pipelining at pp 1, interleaved 1F1B with ``--vp``, else 1F1B;
* ``--use-distributed-optimizer`` (or ``--data-parallel-sharding-strategy optim``): the
  optimizer's state sharded over data parallelism: Adam's as the ``distributed-adam`` optimizer
  (Megatron's distributed optimizer), another optimizer's in its own layer-wise mode (``muon``:
  whole parameters per rank, as Megatron-Core's layer-wise distributed optimizer), refused for
  one that has none;
* ``--data-parallel auto``: ``fsdp2`` under ``--use-torch-fsdp2`` (or ``--data-parallel-sharding-
  strategy optim_grads_params``), else ``ddp``.

The core maps no flag to a plugin name: it asks every installed selector (entry-point group
``plugtron.selectors``), so a third party's selector can answer a flag of its own (a
``--use-megatron-fsdp`` for its wrapper) the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugtron.api import (
    ConfigError,
    ConfigSection,
    PluginError,
    fallback,
    opt,
    optimizer_shards_layer_wise,
    selected_drivers,
    wants_sharded_gradients,
)

#: The question selectors answer for a sharded optimizer (core/plugins/selection.py).
OPTIMIZER_SHARDING = "optimizer_sharding"


@dataclass
class MegatronSelection:
    use_distributed_optimizer: bool = opt(False, "--use-distributed-optimizer",
                                          "Shard the optimizer's state over data parallelism: "
                                          "Adam's as --optimizer distributed-adam, an optimizer "
                                          "that needs whole tensors (muon) by whole parameters "
                                          "per rank.", is_flag=True)
    use_torch_fsdp2: bool = opt(False, "--use-torch-fsdp2",
                                "Shard parameters, gradients and optimizer state over dp x cp "
                                "with torch's fully_shard (the fsdp2 data-parallel wrapper).",
                                is_flag=True)
    data_parallel_sharding_strategy: str | None = opt(
        None, "--data-parallel-sharding-strategy",
        "What data parallelism shards (Megatron's levels): no_shard (ddp), optim (ddp with the "
        "distributed optimizer), optim_grads_params (fsdp2); default: what the other flags say.",
        choices=("no_shard", "optim", "optim_grads", "optim_grads_params"))


#: Before contract 3 these were core fields of ``config.parallel``.
SECTION = ConfigSection("megatron", MegatronSelection, title="Megatron's selection flags",
                        formerly=("parallel",))


def _check_sharded_optimizer(config, flags: MegatronSelection, optimizer: str) -> None:
    """The optimizer shards its state over data parallelism in one way or the other."""
    try:
        sharded = wants_sharded_gradients(config) or optimizer_shards_layer_wise(config)
    except PluginError:
        return  # an optimizer that does not load is reported by the plugin check
    if not sharded:
        flag = ("--use-distributed-optimizer" if flags.use_distributed_optimizer
                else "--data-parallel-sharding-strategy optim")
        raise ConfigError(f"{flag} shards the optimizer's state over data parallelism, which "
                          f"--optimizer {optimizer} does not offer (Adam's sharded optimizer is "
                          f"distributed-adam; an optimizer that needs whole tensors answers hook "
                          f"optimizer_shards_layer_wise)")


def _flags(config) -> MegatronSelection:
    return getattr(config, "megatron", None) or MegatronSelection()


class MegatronSelector:
    """A selector is used as a class, like a layer type: its hooks are static."""

    @staticmethod
    def plugtron_config_sections():
        return [SECTION]

    @staticmethod
    def plugtron_select(role, config):
        flags, named = _flags(config), config.plugins
        strategy = flags.data_parallel_sharding_strategy
        if role == "schedule" and named.schedule == "auto":  # Megatron's choice by layout
            if config.parallel.pipeline_model_parallel_size <= 1:
                return fallback("no-pipelining")
            if config.parallel.virtual_pipeline_model_parallel_size:
                return fallback("interleaved-1f1b")
            return fallback("1f1b")
        sharded = flags.use_distributed_optimizer or strategy == "optim"
        if role == OPTIMIZER_SHARDING and sharded:
            return "data_parallel"
        if role == "optimizer" and sharded and named.optimizer in ("auto", "adam",
                                                                   "distributed-adam"):
            return "distributed-adam"
        if role == "data_parallel" and named.data_parallel == "auto":
            if flags.use_torch_fsdp2 or strategy == "optim_grads_params":
                return "fsdp2"
            return fallback("ddp")
        return None

    @staticmethod
    def plugtron_validate(config):
        flags = _flags(config)
        drivers = selected_drivers(config)
        wrapper = drivers["data_parallel"]
        if flags.use_distributed_optimizer or flags.data_parallel_sharding_strategy == "optim":
            _check_sharded_optimizer(config, flags, drivers["optimizer"])
        if flags.use_torch_fsdp2 and wrapper != "fsdp2":
            raise ConfigError(f"--use-torch-fsdp2 selects the data-parallel wrapper fsdp2 and "
                              f"cannot be combined with --data-parallel {wrapper}")
        strategy = flags.data_parallel_sharding_strategy
        if strategy == "optim_grads":
            raise ConfigError("--data-parallel-sharding-strategy optim_grads: gradients alone "
                              "(ZeRO-2) are not offered; use optim (ddp with the distributed "
                              "optimizer) or optim_grads_params (fsdp2: --use-torch-fsdp2)")
        if wrapper == "ddp" and strategy == "optim_grads_params":
            raise ConfigError("--data-parallel-sharding-strategy optim_grads_params is the fsdp2 "
                              "wrapper: drop --data-parallel ddp (or use optim, ddp with the "
                              "distributed optimizer)")
        if wrapper == "fsdp2" and strategy in ("no_shard", "optim"):
            raise ConfigError(f"--data-parallel-sharding-strategy {strategy} with fsdp2: fsdp2 "
                              f"shards parameters, gradients and optimizer state "
                              f"(optim_grads_params); for {strategy} use the ddp wrapper"
                              + (" with --use-distributed-optimizer" if strategy == "optim"
                                 else ""))
