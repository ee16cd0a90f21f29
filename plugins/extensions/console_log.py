"""Extension ``logging``: tells the user on rank 0 what the run is made of."""

from __future__ import annotations

from plugtron.api import (
    estimate_memory,
    hookimpl,
    model_info_for,
    selected_driver,
    selected_drivers,
)


class ConsoleLog:
    def __init__(self):
        self.rank = 0
        self.world_size = 1

    @hookimpl
    def plugtron_process_groups_ready(self, parallel):
        self.rank = parallel.rank
        self.world_size = parallel.world_size

    @hookimpl
    def plugtron_train_start(self, config, state):
        if self.rank != 0:
            return
        m, p = config.model, config.parallel
        drivers = ", ".join(f"{k}={v}" for k, v in selected_drivers(config).items())
        cp = f"cp {p.context_parallel_size}"
        if p.context_parallel_size > 1:
            cp += f" ({p.cp_comm_type})"
        backend = selected_driver(config, "layer_backend")
        print(f"plugtron: {drivers}, layer_backend={backend}", flush=True)
        # The model says its depth (a Hybrid model's is its pattern's, not --num-layers).
        layers = model_info_for(config).architecture.get("--num-layers", m.num_layers)
        print(f"plugtron: {layers} layers, hidden {m.hidden_size}, seq "
              f"{m.seq_length}, vocab {m.vocab_size} (padded "
              f"{m.padded_vocab_size}); tp {p.tensor_model_parallel_size} pp "
              f"{p.pipeline_model_parallel_size} {cp}; starting at "
              f"iteration {state.iteration}", flush=True)
        print(f"plugtron: {memory_line(config, self.world_size)}", flush=True)


def memory_line(config, world_size: int) -> str:
    """The largest rank's memory estimate (``plugtron estimate`` has the table)."""
    try:
        return estimate_memory(config, world_size).header_line()
    except Exception as exc:  # noqa: BLE001 - the header must never stop a run
        return f"memory estimate unavailable ({type(exc).__name__}: {exc})"
