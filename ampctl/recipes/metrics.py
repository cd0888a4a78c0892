"""Held-out metrics the built-in recipes give (engine/evaluation.py): sums over a batch's examples and their
count, so that means over batches of any size are exact. Computed in fp32 from the model's logits, whatever the
precision they came in."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The held-out streams of the synthetic recipes are drawn from this seed; training draws from train.seed (a run
# with train.seed equal to it would train on its held-out data).
EVAL_SEED = 1_592_715_937


def classification_sums(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Cross-entropy and top-1 accuracy summed over the examples (the rows of logits), and their count."""
    logits = logits.float().reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    return {"loss": F.cross_entropy(logits, targets, reduction="sum"),
            "accuracy": (logits.argmax(dim=-1) == targets).sum().float(),
            "count": torch.tensor(float(targets.numel()), device=logits.device)}


class ImageClassification:
    """The loss and held-out metrics of a recipe whose batches are (images, labels) and whose model gives logits:
    resnet's and timm's, written once."""

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def eval_metrics(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, y = batch
        return classification_sums(model(x), y)
