"""HybridModel: one pipeline chunk of a decoder whose layers follow a pattern of layer types.

The GPT model's embedding, output layer, loss and tied-weight handling, with one layer type per
decoder layer (``decoder.layers.{i}`` is the pattern's i-th symbol, ``|`` not counted) and no
learned position embeddings (Megatron-Core's hybrid model; Mamba layers carry position, and
``--position-embedding-type rope`` still gives attention layers rotary embeddings). Layer types
are found by symbol (``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` from plugtron-moe), never
imported.
"""

from __future__ import annotations

from plugtron_gpt.gpt.model import GPTModel
from plugtron_gpt.hybrid.pattern import chunk_of, layer_symbols
from plugtron_gpt.hybrid.sizes import with_pattern_layers


class HybridModel(GPTModel):
    learned_positions = False

    def __init__(self, config, backend, parallel, pre_process: bool, post_process: bool,
                 vp_stage: int | None = None):
        super().__init__(with_pattern_layers(config), backend, parallel, pre_process,
                         post_process, vp_stage)

    def layer_plan(self, config, parallel, vp_stage, layer_symbols_=None) -> dict[int, str]:
        pattern, p = config.hybrid.layer_pattern, config.parallel
        indices = chunk_of(pattern, parallel.pp_size, parallel.pp_rank,
                           p.virtual_pipeline_model_parallel_size, vp_stage,
                           p.decoder_first_pipeline_num_layers,
                           p.decoder_last_pipeline_num_layers, parallel.pipeline_placement)
        symbols = layer_symbols(pattern)
        return {index: symbols[index] for index in indices}
