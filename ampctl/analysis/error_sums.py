"""One quantity's error against its reference, as running float64 sums over every batch (`ampctl diff`,
analysis/layer_errors.py): the relative RMS error, the cosine, the largest absolute error, and the shares of values
the candidate's type flushed to zero or saturated."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ErrorSums:
    """Running float64 sums of one quantity's candidate against its reference, over every batch."""

    diff_sq: float = 0.0
    ref_sq: float = 0.0
    cand_sq: float = 0.0
    dot: float = 0.0
    max_abs: float = 0.0
    values: int = 0
    nonfinite: int = 0  # candidate values that are inf or NaN where the reference's are finite
    flushed: int = 0  # candidate values that are 0 where the reference's are not
    saturated: int = 0  # at the candidate type's largest finite magnitude, or beyond it

    def add(self, cand: torch.Tensor, ref: torch.Tensor) -> None:
        held, reference = cand.detach().reshape(-1), ref.detach().reshape(-1)
        # as the candidate holds them: what its type lost (compared in its own type, one pass each, no copy)
        low = held.is_floating_point() and held.dtype != torch.float64
        counts = [((held == 0) & (reference != 0)).sum(), (held.abs() >= torch.finfo(held.dtype).max).sum()] if low \
            else []
        c, r = held.double(), reference.double()
        sums = self._sums(c, r, counts)
        if not all(math.isfinite(v) for v in sums[:5]):  # rare: only then the masks and copies
            bad = ~torch.isfinite(c) & torch.isfinite(r)
            self.nonfinite += int(bad.sum())
            held, reference = held[~bad], reference[~bad]
            counts = [((held == 0) & (reference != 0)).sum(), (held.abs() >= torch.finfo(held.dtype).max).sum()] \
                if low else []
            sums = self._sums(c[~bad], r[~bad], counts)
        self.diff_sq += sums[0]
        self.ref_sq += sums[1]
        self.cand_sq += sums[2]
        self.dot += sums[3]
        self.max_abs = max(self.max_abs, sums[4])
        self.values += cand.numel()
        if low:
            self.flushed += int(sums[5])
            self.saturated += int(sums[6])

    @staticmethod
    def _sums(c: torch.Tensor, r: torch.Tensor, counts: list[torch.Tensor]) -> list[float]:
        """||c - r||^2, ||r||^2, ||c||^2, c.r, max |c - r| and the counts: one read back (aminmax: no |c - r| made)."""
        d = c - r
        low, high = torch.aminmax(d) if d.numel() else (d.new_zeros(()), d.new_zeros(()))
        return torch.stack([d @ d, r @ r, c @ c, c @ r, torch.maximum(high, -low), *(n.double() for n in counts)
                            ]).tolist()

    @property
    def rel_rms(self) -> float:
        """||candidate - reference|| / ||reference|| over every batch; inf where the candidate was not finite."""
        if self.nonfinite:
            return math.inf
        if self.ref_sq == 0.0:
            return 0.0 if self.diff_sq == 0.0 else math.inf
        return math.sqrt(self.diff_sq / self.ref_sq)

    @property
    def cosine(self) -> Optional[float]:
        if self.nonfinite or self.ref_sq == 0.0 or self.cand_sq == 0.0:
            return None
        return self.dot / math.sqrt(self.ref_sq * self.cand_sq)

    def share(self, count: int) -> float:
        return count / self.values if self.values else 0.0
