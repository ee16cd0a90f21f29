"""``plugtron.api.generate``: text generation from a loaded model, with a KV cache.

The loop feeds the model through the same ``module(tokens, position_ids)`` call that training
uses; what generation adds reaches the layers through the forward context
(``forward_context(inference=state)``): an :class:`InferenceState` holds each attention layer's
cached tensors (keyed by the layer's name) and says which keys a query may see. An attention
layer that finds a state appends this step's tensors (:meth:`InferenceState.update`: its k and
v, or whatever per-token tensors it rebuilds them from, such as a compressed latent) and its
core attention masks with :meth:`InferenceState.attention_mask` (causal with an offset, as the
new queries sit at the end of the cached sequence, and never a padding key).

Prompts of different lengths are left-padded: every row's next token is then in the same
column. Positions count each row's own tokens (the first real token is position 0), so a padded
row gets exactly the tokens it gets alone.

Layer types whose state between steps lives in the InferenceState declare
``supports_kv_cache = True``: an attention layer keeps its k/v (or what it makes them from), a
layer without state keeps nothing, a recurrent layer keeps its state in ``state.recurrent`` (and
makes padding tokens no-ops). A model with any other layer is run without a cache and one row at
a time: the whole prefix is recomputed for every new token, with no padding that an unknown
layer would read.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
from plugtron.core.blocks.forward_context import forward_context


class InferenceState:
    """The generation state of one batch: per-layer KV cache and the key padding.

    ``key_valid``: ``[batch, max_length]`` bool, False at a row's left padding. With
    ``use_cache`` False nothing is kept and every forward sees the whole sequence (the uncached
    reference path, still masking padding)."""

    def __init__(self, key_valid: torch.Tensor, use_cache: bool = True):
        self.key_valid = key_valid
        self.max_length = key_valid.shape[1]
        self.use_cache = use_cache
        self.offset = 0  # tokens of every row already in the cache
        #: Per-layer cached tensors, by layer name: ``[batch, max_length, ...]`` buffers.
        self._cache: dict[str, tuple[torch.Tensor, ...]] = {}
        #: Per-layer state of recurrent layers (e.g. a convolution window), by layer name.
        self.recurrent: dict[str, object] = {}

    def valid(self, num_tokens: int) -> torch.Tensor:
        """``[b, num_tokens]`` bool: which of this step's tokens are real (not padding)."""
        return self.key_valid[:, self.offset:self.offset + num_tokens]

    def update(self, key: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append this step's per-token tensors of layer ``key`` (each ``[b, s, ...]``; an
        attention layer's ``k, v``, or what it rebuilds them from) at the current offset;
        returns each one's cached sequence so far (``[b, offset + s, ...]``), in the same
        order. A layer gives the same number of tensors, of the same trailing shapes and
        dtypes, at every step."""
        if not self.use_cache:
            return tensors
        if key not in self._cache:  # allocated once: appending never copies the prefix
            self._cache[key] = tuple(
                t.new_empty((t.shape[0], self.max_length, *t.shape[2:])) for t in tensors)
        cached = self._cache[key]
        if len(cached) != len(tensors):
            raise ValueError(f"{key} cached {len(cached)} tensors and now gives {len(tensors)}")
        end = self.offset + tensors[0].shape[1]
        if end > self.max_length:
            raise ValueError(f"KV cache of {self.max_length} positions is full (needs {end})")
        for buffer, t in zip(cached, tensors):
            buffer[:, self.offset:end] = t
        return tuple(buffer[:, :end] for buffer in cached)

    def cached(self, key: str) -> tuple[torch.Tensor, ...]:
        """Layer ``key``'s cache buffers, ``[b, max_length, ...]`` each (empty: never updated)."""
        return self._cache.get(key, ())

    def bytes_per_token(self, key: str | None = None) -> int:
        """Bytes the cache holds per token (one row, one position): of layer ``key``, or of
        every layer when None (the recurrent states, which do not grow, are not counted)."""
        keys = [key] if key is not None else list(self._cache)
        return sum(t[0, 0].numel() * t.element_size() for k in keys for t in self.cached(k))

    def advance(self, num_tokens: int) -> None:
        """Called by the loop after each forward: the step's tokens are now in the cache."""
        if self.use_cache:
            self.offset += num_tokens

    def attention_mask(self, q_len: int, k_len: int) -> torch.Tensor:
        """``[b, 1, q_len, k_len]`` bool, True where a query may attend: the queries are the
        last ``q_len`` of the ``k_len`` positions (causal with an offset) and padding keys are
        hidden. A padding query sees itself, so that no row of the softmax is empty (NaN)."""
        device = self.key_valid.device
        k_pos = torch.arange(k_len, device=device)
        q_pos = k_pos[k_len - q_len:]
        causal = k_pos[None, :] <= q_pos[:, None]
        mask = causal[None] & self.key_valid[:, None, :k_len]
        mask |= (k_pos[None, :] == q_pos[:, None])[None]
        return mask[:, None]


@dataclasses.dataclass
class GenerationResult:
    """``tokens``: the new ids of each row (ending with eod when it stopped there, without the
    padding of rows that finished early); ``texts``: their detokenized text when a tokenizer
    was given (cut before a ``stop`` string); ``finish_reasons``: ``"eod"``, ``"stop"`` or
    ``"length"`` per row."""

    tokens: list[list[int]]
    texts: list[str] | None
    finish_reasons: list[str]


def supports_kv_cache(module: torch.nn.Module) -> bool:
    """True when every decoder layer part of ``module`` declares ``supports_kv_cache``."""
    parts = [part for m in module.modules() for part in getattr(m, "parts", ())]
    return bool(parts) and all(getattr(part, "supports_kv_cache", False) for part in parts)


def position_limit(model_config) -> int | None:
    """The longest sequence a model with learned absolute positions can embed (None: RoPE or
    no position embedding, no table to run past)."""
    if getattr(model_config, "position_embedding_type", None) != "learned_absolute":
        return None
    return model_config.max_position_embeddings or model_config.seq_length


def _check(prompts, max_new_tokens, temperature, top_k, top_p) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature} (use greedy for argmax)")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample(logits: torch.Tensor, greedy: bool, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator | None) -> torch.Tensor:
    """The next token ``[b]`` from fp32 logits ``[b, vocab]``: argmax, or a draw after
    temperature, top-k (keep the k largest) and top-p (keep the smallest set of tokens whose
    probability reaches p; the most likely token always stays)."""
    if greedy:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
        drop = before >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def _left_pad(prompts: Sequence[Sequence[int]], total: int, pad_id: int, device):
    batch, longest = len(prompts), max(len(p) for p in prompts)
    tokens = torch.full((batch, total), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros((batch, total), dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt):longest] = torch.tensor(list(prompt), dtype=torch.long)
        valid[row, longest - len(prompt):] = True  # generated columns are real for every row
    return tokens, valid, longest


class _Stopper:
    """Per-row stop conditions: eod, stop strings (on the detokenized text), length."""

    def __init__(self, batch, eod, stop, tokenizer):
        self.eod, self.stop, self.tokenizer = eod, list(stop), tokenizer
        self.tokens = [[] for _ in range(batch)]
        self.reasons: list[str | None] = [None] * batch

    def add(self, row: int, token: int) -> None:
        self.tokens[row].append(token)
        if self.eod is not None and token == self.eod:
            self.reasons[row] = "eod"
        elif self.stop and any(s in self.tokenizer.detokenize(self.tokens[row])
                               for s in self.stop):
            self.reasons[row] = "stop"

    def text(self, row: int) -> str:
        ids = self.tokens[row]
        if self.reasons[row] == "eod":
            ids = ids[:-1]
        text = self.tokenizer.detokenize(ids)
        for s in self.stop:
            if s in text:
                text = text[:text.index(s)]
        return text


def _model_parts(model):
    """(module called as ``module(tokens, position_ids)``, vocabulary size, tp broadcast)."""
    module = getattr(model, "module", model)
    config = getattr(model, "config", None) or getattr(module, "config", None)
    vocab = getattr(model, "vocab_size", None) or (config.model.vocab_size if config else None)
    return module, vocab, getattr(model, "agree", None)


@torch.no_grad()
def generate(model, prompts, max_new_tokens: int, *, greedy: bool = False,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, eod: int | None = None, stop: Sequence[str] = (),
             tokenizer=None, use_cache: bool | None = None,
             on_tokens: Callable[[list[int | None], list[bool]], None] | None = None
             ) -> GenerationResult:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    ``model``: what :func:`plugtron.api.load_model` returns (or a GPT-style chunk with
    ``pre_process`` and ``post_process``). ``prompts``: lists of token ids, or strings when a
    ``tokenizer`` is given. A row stops at ``eod`` (default: the tokenizer's) or when its text
    contains one of ``stop``. ``use_cache``: the KV cache (default: when every layer supports
    it). ``on_tokens(new, finished)``: called after every step with each row's new token
    (``None`` for a row that had already stopped) and whether the row has stopped, to stream
    them."""
    if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
        raise ValueError("prompts must be a list of prompts (each a string or a list of ids)")
    prompts = list(prompts)
    if any(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer (or give token ids)")
        prompts = [tokenizer.tokenize(p) if isinstance(p, str) else list(p) for p in prompts]
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    _check(prompts, max_new_tokens, temperature, top_k, top_p)
    module, vocab, agree = _model_parts(model)
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= int(t) < (vocab or float("inf"))]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary "
                             f"[0, {vocab})")
    config = getattr(model, "config", None) or getattr(module, "config", None)
    limit = position_limit(config.model) if config is not None else None
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the "
                         f"model's {limit} learned positions")
    if eod is None and tokenizer is not None:
        eod = tokenizer.eod
    cacheable = supports_kv_cache(module)
    if use_cache is None:
        use_cache = cacheable
    elif use_cache and not cacheable:
        raise ValueError("this model has layers without KV-cache support (supports_kv_cache); "
                         "generate with use_cache=False")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    stopper = _Stopper(len(prompts), eod, stop, tokenizer)
    rows = [list(range(len(prompts)))] if cacheable else [[i] for i in range(len(prompts))]
    for group in rows:  # without cache support: one row at a time, no padding
        _generate_rows(module, vocab, agree, [prompts[i] for i in group], group,
                       max_new_tokens, use_cache, stopper, on_tokens, len(prompts),
                       (greedy, temperature, top_k, top_p, generator))
    texts = None if tokenizer is None else [stopper.text(r) for r in range(len(prompts))]
    return GenerationResult(stopper.tokens, texts, [r or "length" for r in stopper.reasons])


def _generate_rows(module, vocab, agree, prompts, row_ids, max_new_tokens, use_cache, stopper,
                   on_tokens, batch, sampling):
    device = next(module.parameters()).device
    total = max(len(p) for p in prompts) + max_new_tokens
    tokens, valid, longest = _left_pad(prompts, total, 0, device)
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
    state = InferenceState(valid, use_cache=use_cache)
    end, start = longest, 0
    for _ in range(max_new_tokens):
        with forward_context(inference=state):
            logits = module(tokens[:, start:end], positions[:, start:end])
        state.advance(end - start)
        logits = logits[:, -1, :vocab].float()
        chosen = sample(logits, *sampling)
        if agree is not None:
            chosen = agree(chosen)  # every tp rank continues with the same tokens
        tokens[:, end] = chosen
        streamed: list[int | None] = [None] * batch
        for local, row in enumerate(row_ids):
            if stopper.reasons[row] is None:
                stopper.add(row, int(chosen[local]))
                streamed[row] = int(chosen[local])
        end += 1
        if end == tokens.shape[1]:
            for row in row_ids:
                stopper.reasons[row] = stopper.reasons[row] or "length"
        if on_tokens is not None:
            on_tokens(streamed, [reason is not None for reason in stopper.reasons])
        start = end - 1 if use_cache else 0
        if all(stopper.reasons[row] is not None for row in row_ids):
            break
