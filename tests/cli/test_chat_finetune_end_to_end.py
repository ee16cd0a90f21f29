"""The fine-tune a user runs, from the docs: a Hugging Face Llama with a chat tokenizer, a LoRA
fine-tune on chat records packed at tp 2 x cp 2 (4 ranks), exported to Hugging Face (adapters
merged), and greedy generation from a chat-templated prompt: transformers on the exported model
gives the tokens `plugtron generate` gives from the fine-tune's checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.plugins.datasets.test_sft import chat_tokenizer  # noqa: F401 - the fixture

transformers = pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": f"what is {a} and {b}?"},
     {"role": "assistant", "content": f"{a + b}, and {a} times {b} is {a * b}."}]
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (9, 3)]
] + [[{"role": "system", "content": "short answers"}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "name?"},
      {"role": "assistant", "content": "plugtron"}]]


def _plugtron(*args, timeout=600):
    done = subprocess.run([sys.executable, "-m", "plugtron.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_hf_model_lora_sft_at_tp2_cp2_exported_generates_like_transformers(
        tmp_path, chat_tokenizer):  # noqa: F811
    hf = tmp_path / "hf"
    config = transformers.LlamaConfig(
        vocab_size=chat_tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=False,
        eos_token_id=chat_tokenizer.eos, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    chat_tokenizer.save(str(hf))
    records = tmp_path / "chats.jsonl"
    records.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))

    ckpt, out = tmp_path / "ft", tmp_path / "hf-out"
    _plugtron("train", "--pretrained-checkpoint", str(hf), "--finetune",
              "--lora-rank", "4", "--lora-alpha", "8",
              "--data", "sft", "--data-path", str(records), "--split", "100,0,0",
              "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf),
              "--tp", "2", "--cp", "2", "--nproc-per-node", "4", "--seq-length", "64",
              "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
              "--lr", "5e-2", "--lr-warmup-iters", "0", "--hidden-dropout", "0",
              "--attention-dropout", "0", "--eval-interval", "0", "--no-progress",
              "--save", str(ckpt))
    _plugtron("convert", "export-hf", str(ckpt), str(out))

    prompt = chat_tokenizer.render_chat([{"role": "user", "content": "what is 3 and 4?"}],
                                        add_generation_prompt=True)
    generated = json.loads(_plugtron("generate", "--load", str(ckpt), "--chat", "--prompt",
                                     "what is 3 and 4?", "--max-new-tokens", "8",
                                     "--greedy", "--json").strip().splitlines()[-1])
    assert generated["prompt_ids"] == prompt  # --chat: the user turn in the chat template
    ours = generated["tokens"]  # the new tokens
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert len(ours) == 8 and ours == theirs, (ours, theirs)
    # the fine-tune changed the model: the base alone answers otherwise (or the test is void)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        logits_base = base(torch.tensor([prompt])).logits[0, -1]
        logits_tuned = model(torch.tensor([prompt])).logits[0, -1]
    assert (logits_base - logits_tuned).abs().max() > 1e-3
