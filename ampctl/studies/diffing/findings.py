"""What a diff found, as its records hold it: the whole model's figures and their verdict (ModelSummary, diff.json's
"model"), and diff.prove's verdict (Proof)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from ampctl.analysis.layer_errors import ModelErrors


def error_cell(value: float) -> str:
    return "inf" if math.isinf(value) else "0" if value == 0 else f"{value:.1e}"


@dataclass
class ModelSummary:
    """The whole model's figures and the yardstick's verdict (diff.json's "model")."""

    candidate: str
    against: str
    batches: int
    reference_loss: Optional[float]  # the reference's mean loss over the batches
    loss_error: float  # the candidate's mean |loss - reference's|
    loss_noise: Optional[float]  # the reference loss's batch-to-batch spread
    gradient_error: float  # the whole gradient's relative RMS error
    gradient_cosine: float
    gradient_noise: Optional[float]  # the gradient's batch-to-batch noise: the yardstick (None: one batch)
    error_over_noise: Optional[float]
    below_the_noise: bool  # error_over_noise <= noise_share
    noise_share: float
    largest_shares: list[tuple[str, float]]  # the three layers with the largest shares of the gradient's error
    loss_scale: float  # the candidate's loss scale the batches ran under
    scale_backoffs: int  # times it was halved for an overflowing gradient, as GradScaler would
    converted_layers: list[str] = field(default_factory=list)  # the layers the candidate's mode converts

    @classmethod
    def of(cls, model: ModelErrors, candidate: str, against: str, noise_share: float, loss_scale: float,
           converted_layers: list[str]) -> "ModelSummary":
        noise, error = model.noise(), model.gradient.rel_rms
        ratio = error / noise if noise else None
        reference_loss = sum(r for r, _ in model.losses) / len(model.losses) if model.losses else None
        return cls(candidate, against, len(model.losses), reference_loss, model.loss_error(), model.loss_noise(),
                   error, model.gradient.cosine, noise, ratio, ratio is not None and ratio <= noise_share, noise_share,
                   sorted(model.by_layer.items(), key=lambda item: -item[1])[:3], loss_scale, model.backoffs,
                   converted_layers)

    @classmethod
    def read(cls, record: dict[str, Any]) -> "ModelSummary":
        """From diff.json's "model" (one written before converted_layers was recorded reads as none)."""
        known = {f.name for f in fields(cls)}
        summary = cls(**{k: v for k, v in record.items() if k in known})
        summary.largest_shares = [(name, share) for name, share in summary.largest_shares]
        return summary

    def lines(self) -> list[str]:
        """What the figures say, in words."""
        candidate, against, loss_noise = self.candidate, self.against, self.loss_noise
        lines = [f"loss: {against}'s {self.reference_loss:.4f}; {candidate}'s differs by "
                 f"{error_cell(self.loss_error)} on average"
                 + (f" (its batch-to-batch spread: {loss_noise:.3g})" if loss_noise else "")]
        if self.scale_backoffs:
            lines.append(f"loss scale: its gradient overflowed; compared under {self.loss_scale:g}, halved "
                         f"{self.scale_backoffs} times as GradScaler would")
        ratio, share = self.error_over_noise, self.noise_share
        gradient = f"gradient: relative error {error_cell(self.gradient_error)}"
        if ratio is None:
            return [*lines, f"{gradient}; the gradient's batch-to-batch noise could not be measured (diff.batches >= "
                            "2)"]
        noise = (f"the gradient's batch-to-batch noise is {self.gradient_noise:.3g}: the error is "
                 f"{'all' if math.isinf(ratio) else f'{ratio:.2g}x'} of it")
        if self.below_the_noise:
            return [*lines, f"{gradient}; {noise}, below diff.noise_share={share:g}: at these weights {candidate}'s "
                            "error is far inside what SGD's own noise already does to training"]
        largest = ", ".join(f"{name} ({part:.0%})" for name, part in self.largest_shares)
        return [*lines, f"{gradient}; {noise}, not below diff.noise_share={share:g}: at these weights {candidate} "
                        f"can change training. Largest shares of the gradient's error: {largest}"]


@dataclass
class Proof:
    """diff.prove's verdict (studies/diffing/diff_proof.py)."""

    verdict: str  # proved | repaired matches | not needed | not proved | not decided | partial | interrupted
    words: str
    parity: dict[str, Optional[str]]  # each trained mode's held-out parity with the reference
