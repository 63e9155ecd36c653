"""Validation's torch reference, recorded on an export-cache miss and replayed on a hit
(cache.py keeps the recording with the entry; stages.py validates against either)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch


class Reference(Protocol):
    """What validation compares the engine with: the torch model, or logits replayed from the cache."""

    def reference(self, tokens: torch.Tensor) -> torch.Tensor: ...


class ReferenceMiss(LookupError):
    """The cached reference was recorded for other tokens: validate against the real model."""


class RecordingReference:
    """Wraps the torch model for validate(): passes `reference` calls through and keeps what a
    replay needs (the last call's logits in full, every call's last row)."""

    def __init__(self, model: Reference) -> None:
        self.model = model
        self.lengths: list[int] = []
        self.last_rows: list[np.ndarray] = []
        self.tokens: list[int] | None = None
        self.final: np.ndarray | None = None

    def reference(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model.reference(tokens)
        array = out.detach().float().numpy()
        self.lengths.append(int(array.shape[0]))
        self.last_rows.append(array[-1].copy())
        self.tokens, self.final = [int(t) for t in tokens.reshape(-1).tolist()], array.copy()
        return out

    def save(self, path: Path) -> bool:
        if self.final is None or self.tokens is None:
            return False
        np.savez(
            path,
            tokens=np.asarray(self.tokens, dtype=np.int64),
            final=self.final,
            lengths=np.asarray(self.lengths, dtype=np.int64),
            last_rows=np.stack(self.last_rows),
        )
        return True


class CachedReference:
    """Replays RecordingReference's logits: each call's last row exactly as recorded, earlier
    rows from the longest call (causal: a prefix's rows do not depend on later tokens)."""

    def __init__(self, path: Path) -> None:
        with np.load(path) as data:
            self.tokens = [int(t) for t in data["tokens"]]
            self.final = data["final"]
            self.rows = {int(n): row for n, row in zip(data["lengths"], data["last_rows"])}

    def reference(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = [int(t) for t in tokens.reshape(-1).tolist()]
        n = len(ids)
        if n not in self.rows or ids != self.tokens[:n]:
            raise ReferenceMiss(f"no cached reference logits for this {n}-token sequence")
        if n == len(self.tokens):
            return torch.from_numpy(self.final.copy())
        return torch.from_numpy(np.concatenate([self.final[: n - 1], self.rows[n][None]]))
