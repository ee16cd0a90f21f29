"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to min_lr."""

from __future__ import annotations

import math


class LRScheduler:
    def __init__(self, optimizer, max_lr: float, min_lr: float, warmup_iters: int,
                 decay_iters: int, decay_style: str):
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_iters, self.decay_iters = warmup_iters, max(decay_iters, 1)
        self.decay_style = decay_style
        self.num_steps = 0

    @classmethod
    def from_config(cls, optimizer, config) -> "LRScheduler":
        t = config.training
        return cls(optimizer, t.lr, t.min_lr, t.lr_warmup_iters,
                   t.lr_decay_iters or t.train_iters, t.lr_decay_style)

    def lr_at(self, step: int) -> float:
        """The lr of 1-based iteration ``step``."""
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.max_lr * step / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_iters:
            return self.min_lr
        span = max(self.decay_iters - self.warmup_iters, 1)
        ratio = (step - self.warmup_iters) / span
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def prepare(self, step: int) -> float:
        """Set the lr for iteration ``step`` on every param group and return it."""
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        self.num_steps = step
        return lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_iters": self.warmup_iters, "decay_iters": self.decay_iters,
                "decay_style": self.decay_style}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
