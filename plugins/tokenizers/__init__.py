"""Built-in tokenizers (entry-point group ``plugtron.tokenizers``), named as in Megatron-LM."""
