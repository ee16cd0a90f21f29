"""Context parallelism (cp): which tokens of a sample a cp rank holds, and who may run under cp.

The split (Megatron's load-balanced layout for causal attention): every cp rank of a data-parallel
rank draws the same samples; each is cut along the sequence into ``2 x cp`` equal chunks and cp
rank ``r`` keeps chunks ``r`` and ``2 x cp - 1 - r``. Under the causal mask an early chunk is cheap
and a late one dear, so pairing them gives every rank the same attention work. Every tensor of the
microbatch whose sequence dimension has the full length travels the same way (tokens, labels, loss
mask, position ids, the query rows of an attention mask), so the model sees the true position of
each local token and RoPE or learned positions stay right.

Packed documents (the batch's ``attention_mask`` holds document numbers) are split per document,
as Megatron's THD format is under cp: when every document of a sample is a multiple of
``2 x cp`` long, each document is cut into ``2 x cp`` parts and chunk ``c`` is the ``c``-th part
of every document, in sequence order (:func:`chunk_order`). Attention stays inside a document, so
this is what balances the work whatever the documents' lengths (one long document and many short
ones included). A sample with a document of another length is cut as a whole sequence, which is
exact too. The chunk order of a sample is a function of its document numbers alone, so the batch
split and the attention of every rank derive the same one.

Who may run under cp > 1 is declared, never assumed (a layer written without cp in mind would
silently attend only to its local tokens): the model plugin, the layer backend and every layer
type the model builds carry ``supports_context_parallel = True``. :func:`check_support` runs before
launch; :func:`check_built_layers` catches, once the model is built, a layer type that the model
did not name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from plugtron.core.blocks.layer_stack import ComposedLayer
from plugtron.core.blocks.samples import document_runs
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.tensor_parallel import (
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)

#: Attribute a model plugin, layer backend or layer type sets to True to run under ``--cp > 1``.
SUPPORT_ATTRIBUTE = "supports_context_parallel"
COMM_TYPES = ("p2p", "allgather", "a2a")


def local_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the ``2 x cp`` sequence chunks that cp rank ``cp_rank`` holds, in order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_length: int, cp_rank: int, cp_size: int,
                    device=None) -> torch.Tensor:
    """Indices into the full sequence of this rank's tokens (``[seq_length / cp]``, increasing)."""
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device)
                      for i in local_chunk_ids(cp_rank, cp_size)])


def chunk_order(document_ids: torch.Tensor | None, seq_length: int, cp_size: int,
                device=None) -> torch.Tensor:
    """The sequence positions of a sample's tokens in chunk order: chunk ``c`` of ``2 x cp`` is
    ``order[..., c * n:(c + 1) * n]`` (``n = seq_length / (2 x cp)``), so cp rank ``r`` holds
    ``order[..., local_positions(seq_length, r, cp_size)]`` (:func:`rank_positions`).

    Without ``document_ids``: ``arange(seq_length)`` (``[seq]``, the sequence cut as a whole).
    With them (``[b, seq]``): ``[b, seq]``, each document cut in ``2 x cp`` parts where all of the
    sample's documents allow it, the sequence as a whole otherwise."""
    if document_ids is None or cp_size == 1:
        return torch.arange(seq_length, device=device)
    device = device if device is not None else document_ids.device
    parts = 2 * cp_size
    rows = []
    for runs in document_runs(document_ids):
        lengths = torch.tensor([end - start for start, end in runs])
        if bool((lengths % parts).any()):
            rows.append(torch.arange(seq_length))
            continue
        starts = torch.tensor([start for start, _ in runs])
        start = starts.repeat_interleave(lengths)
        part = (lengths // parts).repeat_interleave(lengths)
        position = torch.arange(seq_length)
        rows.append(torch.argsort((position - start) // part * seq_length + position))
    return torch.stack(rows).to(device)


def rank_positions(order: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The sequence positions of cp rank ``cp_rank``'s tokens, given a :func:`chunk_order`."""
    return order[..., local_positions(order.shape[-1], cp_rank, cp_size, order.device)]


def take_positions(x: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``x`` (``[b, seq, ...]`` along ``dim``) at ``positions`` (``[n]``, or ``[b, n]`` per
    sample) along ``dim``."""
    if positions.dim() == 1:
        return x.index_select(dim, positions.to(x.device))
    moved = x.movedim(dim, 1)
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    return moved[rows, positions.to(x.device)].movedim(1, dim)


def batch_document_ids(batch: dict, seq_length: int) -> torch.Tensor | None:
    """The microbatch's document numbers (an integer ``attention_mask`` ``[b, seq]``), or None."""
    ids = batch.get("attention_mask")
    if (torch.is_tensor(ids) and ids.dim() == 2 and ids.shape[1] == seq_length
            and not ids.is_floating_point() and ids.dtype != torch.bool):
        return ids
    return None


def split_tensor(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Keep chunks ``r`` and ``2cp-1-r`` of ``x`` along ``dim`` (cut into ``2 x cp``)."""
    if cp_size == 1:
        return x
    if x.shape[dim] % (2 * cp_size):
        raise ValueError(f"dimension {dim} of shape {tuple(x.shape)} is not divisible by "
                         f"2 x cp = {2 * cp_size}")
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = local_chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def split_context_parallel_batch(batch: dict, seq_length: int, cp_rank: int, cp_size: int) -> dict:
    """This cp rank's slice of a microbatch ``{key: [b, seq, ...]}``.

    Tensors whose dimension 1 has ``seq_length`` entries are split along it; an
    ``attention_mask`` ``[b, 1, s, s]`` keeps its query rows only (dimension 2: every key stays,
    attention reaches them across ranks); document numbers stay whole, and split the sample per
    document where they can (:func:`chunk_order`). Anything else passes through unchanged.
    """
    if cp_size == 1:
        return batch
    documents = batch_document_ids(batch, seq_length)
    positions = None
    if documents is not None:
        positions = rank_positions(chunk_order(documents, seq_length, cp_size), cp_rank, cp_size)
    out = {}
    for key, value in batch.items():
        dim = 2 if key == "attention_mask" else 1
        if torch.is_tensor(value) and value.dim() > dim and value.shape[dim] == seq_length:
            value = (split_tensor(value, dim, cp_rank, cp_size) if positions is None
                     else take_positions(value, positions, dim))
        out[key] = value
    return out


def sum_over_context_parallel(local: torch.Tensor, cp_group) -> torch.Tensor:
    """A loss term of the whole microbatch from this cp rank's share of it (its sum over the
    rank's tokens): forward, the sum over cp; backward, each share gets the gradient summed
    over cp. Every cp rank adds the term to its objective weighted by its own token count
    (``add_loss``); summed back, each share is weighted by the whole microbatch's count, as on
    one process, whatever the split of the counted tokens. The identity without cp."""
    return reduce_from_tensor_parallel_region(copy_to_tensor_parallel_region(local, cp_group),
                                              cp_group)


def local_microbatches(iterator: Iterable[dict], parallel, seq_length: int) -> Iterator[dict]:
    """Wrap a microbatch iterator so each batch is cut to this cp rank's tokens (the identity
    without cp)."""
    if parallel.cp_size == 1:
        yield from iterator
        return
    for batch in iterator:
        yield split_context_parallel_batch(batch, seq_length, parallel.cp_rank, parallel.cp_size)


# --------------------------------------------------------------------------- declarations


def declares_support(obj) -> bool:
    return bool(getattr(obj, SUPPORT_ATTRIBUTE, False))


def check_support(config, model=None, layer_backend=None) -> None:
    """Before launch, with ``--cp > 1``: the sequence splits, the comm type is known, and the
    model plugin and layer backend (objects or classes) declare cp support. Whether the heads
    split for ``a2a`` is the attention layer's to check (it knows its heads)."""
    m, p = config.model, config.parallel
    cp = p.context_parallel_size
    if cp == 1:
        return
    comm_type = p.cp_comm_type
    if comm_type not in COMM_TYPES:
        raise ConfigError(f"--cp-comm-type {comm_type!r} is not one of {', '.join(COMM_TYPES)}")
    tp = p.tensor_model_parallel_size
    if m.seq_length % (2 * cp):
        raise ConfigError(f"--seq-length {m.seq_length} is not divisible by 2 x --cp {cp} = "
                          f"{2 * cp}: context parallelism cuts each sample into 2 x cp equal "
                          f"chunks")
    if p.sequence_parallel and tp > 1 and m.seq_length % (2 * cp * tp):
        raise ConfigError(f"--seq-length {m.seq_length} is not divisible by 2 x --cp {cp} x "
                          f"--tp {tp} = {2 * cp * tp}, which --sequence-parallel with context "
                          f"parallelism needs")
    for what, obj in (("model", model), ("layer backend", layer_backend)):
        if obj is not None and not declares_support(obj):
            name = getattr(obj, "name", None) or type(obj).__name__
            raise ConfigError(f"--cp {cp}: {what} {name!r} does not declare context-parallel "
                              f"support ({SUPPORT_ATTRIBUTE} = True); use --cp 1")


def check_context_parallel_layers(config, layer_types: Iterable[type]) -> None:
    """For a model plugin's validation: with ``--cp > 1`` every layer type it will build must
    declare cp support (a recurrent layer that scans the local tokens only would be wrong)."""
    cp = config.parallel.context_parallel_size
    if cp == 1:
        return
    for cls in layer_types:
        if not declares_support(cls):
            _refuse_layer(cp, cls)


def _layer_modules(module: torch.nn.Module):

    for sub in module.modules():
        yield sub
        if isinstance(sub, ComposedLayer):  # parts sit in a tuple (no name level): look inside
            for part in sub.parts:
                yield from _layer_modules(part)


def check_built_layers(model_chunks, parallel) -> None:
    """After the model is built: every layer-type module (one with a ``symbol``) declares cp
    support. The safety net for a model that composes layer types it did not check."""
    if parallel.cp_size == 1:
        return
    for chunk in model_chunks:
        for sub in _layer_modules(chunk):
            if getattr(type(sub), "symbol", None) and not declares_support(sub):
                _refuse_layer(parallel.cp_size, type(sub))


def _refuse_layer(cp: int, cls: type) -> None:
    raise ConfigError(f"--cp {cp}: layer type {getattr(cls, 'symbol', '?')!r} "
                      f"({cls.__module__}.{cls.__qualname__}) does not support context "
                      f"parallelism ({SUPPORT_ATTRIBUTE} is not set); use --cp 1")
