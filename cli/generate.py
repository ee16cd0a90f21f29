"""``plugtron generate --load CK --prompt TEXT --max-new-tokens N``: text from a checkpoint.

Checked here, before any rank starts (exit 2): the checkpoint, the prompts (text needs the
checkpoint's tokenizer; none may be empty), the sampling values and the layout (tp must divide
the heads; pp > 1 is refused: generation runs whole models on each rank of one tp group). Then
the model is loaded in this process, or in ``--nproc-per-node`` ranks for ``--tp``, and
:func:`plugtron.core.tools.generation.generate` runs; rank 0 prints.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from types import SimpleNamespace

import click
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.distributed import launched_externally

from .errors import user_errors

#: Where a launched rank finds the request (written by the launching process).
REQUEST_ENV = "PLUGTRON_GENERATE_REQUEST"


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ConfigError(f"--prompt-ids {text!r}: give integers separated by commas or "
                          f"spaces") from None


def _chat_prompts(texts: list[str], ids: list, system, tokenizer,
                  tokenizer_type) -> list[list[int]]:
    """Each text prompt as a user turn (after ``system``'s turn) in the tokenizer's chat
    template, ending with the assistant's header (``add_generation_prompt``): the format a chat
    model was fine-tuned on (``--data sft``)."""
    if ids:
        raise ConfigError("--chat renders text prompts in the chat template: give --prompt or "
                          "--prompt-file, not --prompt-ids (ids are taken as they are)")
    if not getattr(tokenizer, "has_chat_template", False):
        raise ConfigError(f"--chat needs a tokenizer with a chat template (HuggingFaceTokenizer "
                          f"of a chat model); the tokenizer ({tokenizer_type}) has none")
    head = [] if system is None else [{"role": "system", "content": system}]
    return [tokenizer.render_chat([*head, {"role": "user", "content": text}],
                                  add_generation_prompt=True) for text in texts]


def _tokenizer(tokenizer_type, tokenizer_model, vocab_size):
    if not tokenizer_type:
        return None
    from plugtron.core.plugins.tokenizers import build_tokenizer

    return build_tokenizer(tokenizer_type, tokenizer_model, vocab_size)


def build_request(load, prompts, prompt_file, prompt_ids, **values) -> dict:
    """The checked request a rank runs (a JSON-able dict); ``ConfigError`` for bad input."""
    from plugtron.core.checkpoint import CheckpointReader

    if not load:
        raise ConfigError("plugtron generate needs --load CK (a checkpoint or a directory of "
                          "them)")
    reader = CheckpointReader(load)
    config, path = reader.config, reader.path
    reader.close()
    model, data = config.get("model", {}), config.get("data", {})
    texts = list(prompts)
    if prompt_file:
        try:
            with open(prompt_file, encoding="utf-8") as f:
                texts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as exc:
            raise ConfigError(f"--prompt-file {prompt_file}: {exc.strerror}") from None
    ids = [_prompt_ids(text) for text in prompt_ids]
    if not texts and not ids:
        raise ConfigError("give a prompt: --prompt TEXT, --prompt-file FILE (one prompt a "
                          "line) or --prompt-ids 1,2,3")
    tokenizer_type = values.pop("tokenizer_type") or data.get("tokenizer_type")
    tokenizer_model = values.pop("tokenizer_model") or data.get("tokenizer_model")
    tokenizer = _tokenizer(tokenizer_type, tokenizer_model, model.get("vocab_size"))
    if (texts or values["stop"]) and tokenizer is None:
        raise ConfigError(f"checkpoint {path} names no tokenizer, so text prompts and --stop "
                          f"cannot be encoded: give --prompt-ids, or --tokenizer-type (and "
                          f"--tokenizer-model)")
    chat, system = values.pop("chat"), values.pop("system")
    if system is not None and not chat:
        raise ConfigError("--system gives a chat's system turn: use it with --chat")
    if chat:
        encoded = _chat_prompts(texts, ids, system, tokenizer, tokenizer_type)
    else:
        encoded = [tokenizer.tokenize(text) for text in texts] + ids
    for i, prompt in enumerate(encoded):
        if not prompt:
            raise ConfigError(f"prompt {i + 1} is empty: every prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < model.get("vocab_size", 0)]
        if bad:
            raise ConfigError(f"prompt {i + 1}: token id {bad[0]} is outside the model's "
                              f"vocabulary [0, {model.get('vocab_size')})")
    if values["max_new_tokens"] <= 0:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {values['max_new_tokens']}")
    if values["temperature"] <= 0:
        raise ConfigError(f"--temperature must be > 0, got {values['temperature']} (--greedy "
                          f"takes the most likely token)")
    if values["top_k"] < 0:
        raise ConfigError(f"--top-k must be >= 0 (0: off), got {values['top_k']}")
    if not 0 < values["top_p"] <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {values['top_p']}")
    from plugtron.core.tools.generation import position_limit

    limit = position_limit(SimpleNamespace(**{k: model.get(k) for k in (
        "position_embedding_type", "max_position_embeddings", "seq_length")}))
    longest = max(len(p) for p in encoded)
    if limit is not None and longest + values["max_new_tokens"] > limit:
        raise ConfigError(f"the longest prompt ({longest} tokens) + --max-new-tokens "
                          f"{values['max_new_tokens']} exceeds the model's {limit} learned "
                          f"positions")
    _check_layout(model, values["tp"], values.pop("pp"), values["nproc_per_node"])
    return {"load": path, "prompts": encoded, "texts": texts + [None] * len(ids),
            "tokenizer_type": tokenizer_type, "tokenizer_model": tokenizer_model, **values}


def _check_layout(model: dict, tp: int, pp: int, nproc: int) -> None:
    if pp != 1:
        raise ConfigError(f"plugtron generate runs whole models: --pp {pp} is not supported "
                          f"(use --tp, or --pp 1)")
    heads = model.get("num_attention_heads") or 1
    groups = model.get("num_query_groups") or heads
    if heads % tp or groups % tp:
        raise ConfigError(f"--tp {tp} must divide the attention heads ({heads}) and query "
                          f"groups ({groups})")
    world = int(os.environ["WORLD_SIZE"]) if launched_externally() else nproc
    if world != tp:
        raise ConfigError(f"plugtron generate --tp {tp} needs exactly {tp} ranks, got {world} "
                          f"(--nproc-per-node {tp})")


class Printer:
    """Streams tokens to stdout as they come: one prompt as running text (ids without a
    tokenizer), several as one line each when the row stops. The last characters are held
    back until the row stops, so that a --stop string is never half printed."""

    def __init__(self, request: dict, tokenizer):
        self.tokenizer, self.stop = tokenizer, request["stop"]
        self.batch = len(request["prompts"])
        self.ids: list[list[int]] = [[] for _ in range(self.batch)]
        self.printed = [0] * self.batch
        self.done = [False] * self.batch
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.eod = tokenizer.eod if tokenizer is not None else None

    def text(self, row: int) -> str:
        ids = self.ids[row]
        if self.tokenizer is None:
            return "".join(f"{t} " for t in ids)
        text = self.tokenizer.detokenize([t for t in ids if t != self.eod])
        for s in self.stop:
            text = text[:text.index(s)] if s in text else text
        return text

    def __call__(self, new, finished) -> None:
        for row, token in enumerate(new):
            if token is not None:
                self.ids[row].append(token)
        if self.batch == 1:
            text = self.text(0)
            shown = text if finished[0] else text[:max(0, len(text) - self.hold)]
            sys.stdout.write(shown[self.printed[0]:])
            self.printed[0] = max(self.printed[0], len(shown))
            if finished[0]:
                sys.stdout.write("\n")
        else:
            for row in range(self.batch):
                if finished[row] and not self.done[row]:
                    sys.stdout.write(f"[{row + 1}] {self.text(row)}\n")
        self.done = list(finished)
        sys.stdout.flush()


def run_generation(request: dict, world=None) -> None:
    """In every rank (or the one process): load, generate, print on rank 0."""
    import torch
    from plugtron.core.tools.generation import generate
    from plugtron.core.tools.inference import load_model

    tp = request["tp"]
    device = request["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(request["load"], device=device, tp=tp, world=world,
                       base=request.get("pretrained_checkpoint"))
    rank = int(os.environ.get("RANK", 0))
    tokenizer = _tokenizer(request["tokenizer_type"], request["tokenizer_model"],
                           model.vocab_size)
    printer = Printer(request, tokenizer) if rank == 0 and not request["json"] else None
    result = generate(model, request["prompts"], request["max_new_tokens"],
                      greedy=request["greedy"], temperature=request["temperature"],
                      top_k=request["top_k"], top_p=request["top_p"], seed=request["seed"],
                      stop=request["stop"], tokenizer=tokenizer,
                      use_cache=False if request["no_kv_cache"] else None, on_tokens=printer)
    if rank == 0 and request["json"]:
        for i, prompt in enumerate(request["prompts"]):
            print(json.dumps({"prompt": request["texts"][i], "prompt_ids": prompt,
                              "tokens": result.tokens[i],
                              "text": result.texts[i] if result.texts else None,
                              "finish_reason": result.finish_reasons[i]}), flush=True)


@click.command(context_settings={"max_content_width": 100})
@click.option("--load", help="Checkpoint (or a directory of them) to generate from.")
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeat for a batch).")
@click.option("--prompt-file", type=click.Path(dir_okay=False),
              help="A file of prompts, one a line.")
@click.option("--chat", is_flag=True, help="Each text prompt is a user turn in the tokenizer's "
              "chat template, followed by the assistant's header.")
@click.option("--system", default=None, help="With --chat: a system turn before each prompt.")
@click.option("--prompt-ids", multiple=True,
              help="A prompt as token ids, e.g. 1,2,3 (repeat for a batch).")
@click.option("--max-new-tokens", type=int, required=True, help="Tokens to add to each prompt.")
@click.option("--greedy", is_flag=True, help="Always the most likely token (no sampling).")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0: off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1: off.")
@click.option("--seed", type=int, default=None, help="Seed of the sampling.")
@click.option("--stop", multiple=True, help="Stop a row when its text contains this (repeat).")
@click.option("--no-kv-cache", is_flag=True,
              help="Recompute the whole prefix for every token (the reference path).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON line per prompt (tokens, text, finish reason) instead of text.")
@click.option("--tokenizer-type", default=None, help="Override the checkpoint's tokenizer.")
@click.option("--tokenizer-model", default=None, help="Override the checkpoint's tokenizer "
              "model.")
@click.option("--tensor-model-parallel-size", "--tp", "tp", type=click.IntRange(min=1),
              default=1, show_default=True)
@click.option("--pipeline-model-parallel-size", "--pp", "pp", type=click.IntRange(min=1),
              default=1, show_default=True, help="Only 1.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=1, show_default=True,
              help="Launch this many local ranks (one per tp rank).")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--pretrained-checkpoint", default=None,
              help="The base model of a fine-tune's checkpoint that holds only its adapters, "
                   "where the path the checkpoint recorded no longer holds it.")
@user_errors
def generate(load, prompts, prompt_file, prompt_ids, as_json, **values):
    """Continue prompts with the model of checkpoint --load, streaming the new text; a row
    stops at the tokenizer's end-of-document token, a --stop string or --max-new-tokens."""
    request = build_request(load, prompts, prompt_file, prompt_ids, json=as_json, **values)
    if request["nproc_per_node"] > 1 and not launched_externally():
        from .evaluate import checkpoint_base
        from .launch import launch_local_ranks

        config = checkpoint_base(load)
        config.parallel.tensor_model_parallel_size = request["tp"]
        with tempfile.TemporaryDirectory(prefix="plugtron-generate-") as tmp:
            path = os.path.join(tmp, "request.json")
            with open(path, "w") as f:
                json.dump(request, f)
            os.environ[REQUEST_ENV] = path
            try:
                launch_local_ranks(config.to_json(), request["nproc_per_node"],
                                   command="generate")
            finally:
                os.environ.pop(REQUEST_ENV, None)
        return
    run_generation(request)


def rank_main(config) -> None:
    """``plugtron.cli.rank generate``: the request the launcher left, on this rank's world."""
    from plugtron.core.parallel.distributed import init_distributed

    with open(os.environ[REQUEST_ENV]) as f:
        request = json.load(f)
    run_generation(request, world=init_distributed())
