"""The actions a pipeline schedule executes, as data: one source of truth for the run and for
``plugtron schedule show``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward or "B" backward
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".c{self.chunk}" if self.chunk else "")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "microbatch": self.microbatch, "chunk": self.chunk}
