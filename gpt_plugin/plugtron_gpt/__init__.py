"""plugtron-gpt: the GPT model plugin (decoder-only transformer, Megatron-Core style)."""
