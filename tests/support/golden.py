"""The canonical torch.amp loop (autocast + GradScaler exactly as in torch's examples) that ampctl's runs are held
to, bit for bit, and the settings both run with."""

from __future__ import annotations

import torch

from ampctl.recipes.mlp import MLPRecipe

STEPS = 12
GOLDEN = ["train.lr.schedule=constant", "train.clip_grad_norm=null", f"train.steps={STEPS}", "train.seed=3"]


def canonical_loop(
    dtype: torch.dtype, use_scaler: bool, init_scale: float = 65536.0, steps: int = STEPS, device: str = "cpu",
    by_hand=lambda model: None,
):
    """autocast + GradScaler exactly as in the torch.amp examples, on the same recipe, seed and batches;
    by_hand(model) changes the model as a user would by hand (autocast off in some layers)."""
    recipe = MLPRecipe(hidden=64, batch_size=32)
    torch.manual_seed(3)
    model = recipe.build_model().to(device)
    by_hand(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale, enabled=use_scaler)
    batches = recipe.batches(torch.device(device), seed=3)
    losses, scales = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast(device, dtype=dtype):
            loss = recipe.loss(model, next(batches))
        scales.append(scaler.get_scale() if use_scaler else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return losses, scales, model
