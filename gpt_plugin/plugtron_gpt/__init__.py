"""plugtron-gpt: decoder-only language models, Megatron-Core style.

- ``layers/``: the layer types both models compose (attention ``*``, MLP ``-``), their options
  (the ``transformer`` section extends the core's ``model`` section) and what they keep for
  backward;
- ``gpt/``: the GPT model plugin (``--model gpt``), its presets, size rules and converters;
- ``hybrid/``: the Hybrid model plugin (``--model hybrid``), the Mamba-2 layer ``M`` and its
  scan, and its converter.
"""
