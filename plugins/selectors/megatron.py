"""Selector ``megatron``: the flags with which Megatron-LM picks a pipeline schedule, an
optimizer and a data-parallel wrapper, answered with plugtron's built-in plugins.

* ``--schedule auto``: no pipelining at pp 1, interleaved 1F1B with ``--vp``, else 1F1B;
* ``--use-distributed-optimizer`` (or ``--data-parallel-sharding-strategy optim``): the
  ``distributed-adam`` optimizer (Megatron's distributed optimizer over Adam);
* ``--data-parallel auto``: ``fsdp2`` under ``--use-torch-fsdp2`` (or ``--data-parallel-sharding-
  strategy optim_grads_params``), else ``ddp``.

The core maps no flag to a plugin name: it asks every installed selector (entry-point group
``plugtron.selectors``), so a third party's selector can answer a flag of its own (a
``--use-megatron-fsdp`` for its wrapper) the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugtron.api import ConfigError, ConfigSection, fallback, opt, selected_drivers


@dataclass
class MegatronSelection:
    use_distributed_optimizer: bool = opt(False, "--use-distributed-optimizer",
                                          "Alias of --optimizer distributed-adam.", is_flag=True)
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
        if role == "optimizer" and (flags.use_distributed_optimizer or strategy == "optim"):
            if named.optimizer not in ("auto", "adam", "distributed-adam"):
                flag = ("--use-distributed-optimizer" if flags.use_distributed_optimizer
                        else "--data-parallel-sharding-strategy optim")
                raise ConfigError(f"{flag} means --optimizer distributed-adam and cannot be "
                                  f"combined with --optimizer {named.optimizer}")
            return "distributed-adam"
        if role == "data_parallel" and named.data_parallel == "auto":
            if flags.use_torch_fsdp2 or strategy == "optim_grads_params":
                return "fsdp2"
            return fallback("ddp")
        return None

    @staticmethod
    def plugtron_validate(config):
        flags = _flags(config)
        wrapper = selected_drivers(config)["data_parallel"]
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
