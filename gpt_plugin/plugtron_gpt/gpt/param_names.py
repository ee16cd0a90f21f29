"""The GPT model's parameter names that the converters map (Megatron-Core's names)."""

EMBEDDING = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm"
