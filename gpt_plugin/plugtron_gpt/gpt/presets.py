"""The GPT model's named sizes for ``--preset`` (hook ``model_presets``); flags and config files
override them."""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # Seconds per run on a laptop CPU: for tests and trying things out.
    "tiny": {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 64,
             "micro-batch-size": 4, "global-batch-size": 8, "train-iters": 20,
             "lr-warmup-iters": 2, "eval-interval": 10, "eval-iters": 2},
    # The default: a few minutes on 2 CPU cores on the standard-library text.
    "small": {},
    # GPT-2 small (124M) sizes.
    "gpt2-124m": {"num-layers": 12, "hidden-size": 768, "num-attention-heads": 12,
                  "seq-length": 1024, "max-position-embeddings": 1024, "lr": 6e-4,
                  "min-lr": 6e-5, "micro-batch-size": 4, "global-batch-size": 32},
    # A small Llama-shaped model: RMSNorm, SwiGLU, rotary, GQA, untied, no biases.
    "llama-tiny": {"num-layers": 4, "hidden-size": 256, "num-attention-heads": 8,
                   "num-query-groups": 2, "ffn-hidden-size": 688, "normalization": "RMSNorm",
                   "swiglu": True, "position-embedding-type": "rope",
                   "untie-embeddings-and-output-weights": True, "add-bias-linear": False},
}
