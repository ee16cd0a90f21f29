"""The loss options of the models built on GPT's output layer (``gpt``, ``hybrid``).

Section ``loss`` extends the core's ``model`` section, so the field reads as
``config.model.cross_entropy_loss_fusion`` where Megatron's users look for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugtron.api import ConfigSection, opt


@dataclass
class LossOptions:
    cross_entropy_loss_fusion: bool = opt(
        False, "--cross-entropy-loss-fusion",
        "Compute the output layer and its cross entropy together, in chunks of tokens: the "
        "logits never exist whole (one float per token kept for backward instead of one per "
        "vocabulary entry) and the loss's passes over them stay in cache, for one more matmul "
        "of the output layer in backward. The same loss up to fp32 rounding.", is_flag=True)


SECTION = ConfigSection("loss", LossOptions, title="Loss", extends="model")
