"""GPT parameter names are Megatron-Core's, the same under every pipeline layout and layer backend
(``te`` on the CPU stand-in of tests/fake_transformer_engine.py); ComposedLayer keeps them flat."""

from __future__ import annotations

import contextlib

import pytest
import torch
from plugtron.core.blocks.layer_stack import ComposedLayer
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.plugins import registry
from plugtron.core.training.loop import finalize_model_config

from tests import fake_transformer_engine
from tests.utils import tiny_config

LAYERS = 4
EMBEDDING = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight"}
FINAL_NORM = {"decoder.final_layernorm.weight", "decoder.final_layernorm.bias"}
OUTPUT = "output_layer.weight"


def layer_names(i: int) -> set[str]:
    layer = f"decoder.layers.{i}"
    return {f"{layer}.{module}.{kind}" for kind in ("weight", "bias")
            for module in ("input_layernorm", "self_attention.linear_qkv",
                           "self_attention.linear_proj", "pre_mlp_layernorm", "mlp.linear_fc1",
                           "mlp.linear_fc2")}


def layers(*indices: int) -> set[str]:
    return set().union(*(layer_names(i) for i in indices))


def backend_context(backend: str):
    return fake_transformer_engine.installed() if backend == "te" else contextlib.nullcontext()


def build_stages(pp: int, vp: int | None, untied: bool, backend: str = "local", tp: int = 1,
                 tp_rank: int = 0, **overrides) -> dict[tuple[int, int], torch.nn.Module]:
    """Every chunk of the layout, keyed by (pp rank, virtual stage), built in this process
    (no process groups: building needs none)."""
    config = tiny_config(num_layers=LAYERS, tp=tp, pp=pp, vp=vp, layer_backend=backend,
                         untie_embeddings_and_output_weights=untied, **overrides)
    gpt = registry.instantiate(registry.load("model", "gpt"))
    chunks = {}
    for pp_rank in range(pp):
        parallel = ParallelContext.build(tp * pp, pp_rank * tp + tp_rank, tp=tp, pp=pp, vp=vp,
                                         create_groups=False)
        finalize_model_config(config, parallel)
        with backend_context(backend):
            layer_backend = registry.load("layer_backend", backend)(config, parallel)
        for v in range(vp or 1):
            chunks[(pp_rank, v)] = gpt.model_provider(
                config=config, pre_process=parallel.is_pipeline_first_stage(v if vp else None),
                post_process=parallel.is_pipeline_last_stage(v if vp else None),
                vp_stage=v if vp else None, layer_backend=layer_backend, parallel=parallel)
    return chunks


def names_of(chunks) -> dict[tuple[int, int], set[str]]:
    return {key: set(chunk.state_dict()) for key, chunk in chunks.items()}


@pytest.mark.parametrize("backend", ["local", "te"])
@pytest.mark.parametrize("untied", [False, True])
def test_single_stage_names(backend, untied):
    names = names_of(build_stages(1, None, untied, backend))
    assert names == {(0, 0): EMBEDDING | layers(0, 1, 2, 3) | FINAL_NORM
                     | ({OUTPUT} if untied else set())}


@pytest.mark.parametrize("backend", ["local", "te"])
@pytest.mark.parametrize("untied", [False, True])
def test_pipeline_stage_names(backend, untied):
    # Tied or not, the last stage holds an output layer: the tied one is a copy of the embedding.
    assert names_of(build_stages(2, None, untied, backend)) == {
        (0, 0): EMBEDDING | layers(0, 1),
        (1, 0): layers(2, 3) | FINAL_NORM | {OUTPUT}}
    # Virtual stage s = v * pp + p holds layer s.
    assert names_of(build_stages(2, 2, untied, backend)) == {
        (0, 0): EMBEDDING | layers(0),
        (1, 0): layers(1),
        (0, 1): layers(2),
        (1, 1): layers(3) | FINAL_NORM | {OUTPUT}}


@pytest.mark.parametrize("pp, vp", [(2, None), (2, 2), (4, None)])
@pytest.mark.parametrize("untied", [False, True])
def test_union_over_stages_is_the_single_stage_model(pp, vp, untied):
    single = set().union(*names_of(build_stages(1, None, untied)).values())
    chunks = build_stages(pp, vp, untied)
    union = set().union(*names_of(chunks).values())
    assert union == single | {OUTPUT}
    owners = [key for key, names in names_of(chunks).items() if OUTPUT in names]
    assert owners == [(pp - 1, (vp or 1) - 1)]
    if not untied:
        first, last = chunks[(0, 0)], chunks[owners[0]]
        assert first.embedding.word_embeddings.weight.shared_group == "embedding.word_embeddings.weight"
        assert last.output_layer.weight.shared_group == "embedding.word_embeddings.weight"


def test_te_builds_the_same_tensors_as_local():
    """Same names, values and sharding declarations, for each tp rank under SP."""
    attributes = ("tensor_model_parallel", "partition_dim", "partition_chunks",
                  "sequence_parallel")
    for tp_rank in range(2):
        local, te = (build_stages(1, None, True, backend, tp=2, tp_rank=tp_rank,
                                  sequence_parallel=True, swiglu=True)[(0, 0)]
                     for backend in ("local", "te"))
        local_params, te_params = dict(local.named_parameters()), dict(te.named_parameters())
        assert set(te_params) == set(local_params)
        for name, param in local_params.items():
            assert torch.equal(te_params[name], param), name
            for attribute in attributes:
                assert (getattr(te_params[name], attribute, None)
                        == getattr(param, attribute, None)), (name, attribute)


@pytest.mark.parametrize("overrides", [{}, {"normalization": "RMSNorm", "swiglu": True,
                                            "num_query_groups": 2}])
def test_te_computes_what_local_computes(overrides):
    """On one rank the stand-in's maths is local's, so the outputs match: the wrappers put
    every bias (fused, or added after the row-parallel reduction) where local does."""
    local, te = (build_stages(1, None, False, backend, **overrides)[(0, 0)]
                 for backend in ("local", "te"))
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    assert torch.allclose(te(tokens, positions), local(tokens, positions), atol=1e-6)


def test_one_layer_type_is_a_whole_decoder_layer():
    """One symbol per layer (the Hybrid model's way): the same names, no level for the type."""
    chunk = build_stages(1, None, False)[(0, 0)]
    config = chunk.config
    attention = registry.load("layer", "attention")(config, chunk.backend, chunk.parallel, 1, 0)
    layer = ComposedLayer([attention])
    assert set(layer.state_dict()) == {n.removeprefix("decoder.layers.0.") for n in layer_names(0)
                                       if ".mlp" not in n and "pre_mlp" not in n}


# --------------------------------------------------------------------------- ComposedLayer


class Part(torch.nn.Module):
    def __init__(self, **children):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)

    def forward(self, hidden, rotary=None):
        return hidden + sum(child(hidden) for child in self.children())


def test_composed_layer_names_are_flat_and_it_runs_the_parts_in_order():
    a, b = Part(norm=torch.nn.LayerNorm(4)), Part(proj=torch.nn.Linear(4, 4))
    layer = ComposedLayer([a, b])
    assert list(layer.state_dict()) == ["norm.weight", "norm.bias", "proj.weight", "proj.bias"]
    assert layer.parts == (a, b)
    x = torch.randn(2, 4)
    assert torch.equal(layer(x), b(a(x)))


def test_composed_layer_refuses_clashing_child_names():
    with pytest.raises(ValueError, match="both have a child named 'norm'"):
        ComposedLayer([Part(norm=torch.nn.LayerNorm(4)), Part(norm=torch.nn.LayerNorm(4))])


@pytest.mark.parametrize("register", ["register_parameter", "register_buffer"])
def test_composed_layer_refuses_tensors_held_by_a_part_itself(register):
    part = Part(norm=torch.nn.LayerNorm(4))
    getattr(part, register)("scale", torch.nn.Parameter(torch.ones(1)))
    with pytest.raises(ValueError, match="holds scale itself"):
        ComposedLayer([part])


def test_composed_layer_refuses_no_parts():
    with pytest.raises(ValueError, match="at least one part"):
        ComposedLayer([])


def test_composed_layer_passes_train_and_eval_to_its_parts():
    parts = [Part(norm=torch.nn.LayerNorm(4)), Part(proj=torch.nn.Linear(4, 4))]
    layer = ComposedLayer(parts)
    layer.eval()
    assert not any(module.training for module in [*parts, *layer.modules()])
    layer.train()
    assert all(module.training for module in [*parts, *layer.modules()])
