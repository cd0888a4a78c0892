"""Configs recorded by an earlier ampctl, read as today's. A run's records (its checkpoints' config, identity.json,
a sweep's command line) say the layout they were written in (CONFIG_VERSION, absent before version 2); a record of
an older layout is migrated as it is read, so that a run directory written before a change still resumes. A key
typed in the old layout on a command line or in a user's YAML is refused in one line naming its new home."""

from __future__ import annotations

import copy
from typing import Any, Optional

# 2: train.* grouped by concern (train.lr, train.checkpoint, train.eval, train.ema, train.cluster)
# 3: torch.compile's keys grouped too (train.compile.enabled, train.compile.mode)
CONFIG_VERSION = 3

# version 1's flat keys -> their homes since version 2
MOVED_IN_2 = {
    "train.lr_schedule": "train.lr.schedule",
    "train.lr_warmup_steps": "train.lr.warmup_steps",
    "train.min_lr_ratio": "train.lr.min_ratio",
    "train.checkpoint_every": "train.checkpoint.every",
    "train.checkpoint_every_s": "train.checkpoint.every_s",
    "train.keep_checkpoints": "train.checkpoint.keep",
    "train.checkpoint_mirror": "train.checkpoint.mirror",
    "train.save_top_k": "train.checkpoint.save_top_k",
    "train.monitor": "train.checkpoint.monitor",
    "train.monitor_mode": "train.checkpoint.monitor_mode",
    "train.eval_every": "train.eval.every",
    "train.eval_batches": "train.eval.batches",
    "train.eval_fp32": "train.eval.fp32",
    "train.ema_decay": "train.ema.decay",
    "train.ema_start_step": "train.ema.start_step",
    "train.ema_every": "train.ema.every",
    "train.preempt_signal": "train.cluster.preempt_signal",
    "train.slurm_requeue": "train.cluster.slurm_requeue",
    "train.hang_after_s": "train.cluster.hang_after_s",
}
# version 2's flat keys -> their homes since version 3 (train.compile: a flag before, its group now)
MOVED_IN_3 = {
    "train.compile": "train.compile.enabled",
    "train.compile_mode": "train.compile.mode",
}
# each layout's moves, by the version that made them, in order
MOVES = {2: MOVED_IN_2, 3: MOVED_IN_3}


def new_home(key: str) -> Optional[str]:
    """Where an old layout's key lives now (`train.eval_every` -> `train.eval.every`), or None."""
    home = None
    for moves in MOVES.values():
        home = moves.get(home or key, home)
    return home


def migrated(config: dict[str, Any], version: Optional[int]) -> dict[str, Any]:
    """A recorded config (a plain dict, resolved) in today's layout; version: the layout it was written in (None:
    before versions were recorded, version 1)."""
    if (version or 1) >= CONFIG_VERSION:
        return config
    moved = copy.deepcopy(config)
    train = moved.get("train")
    if not isinstance(train, dict):
        return moved
    for made_in, moves in MOVES.items():
        if (version or 1) >= made_in:
            continue
        # a flag whose name its group takes (train.compile) leaves before the group is made
        taken = {old.split(".", 1)[1]: train.pop(old.split(".", 1)[1]) for old in moves
                 if old.split(".", 1)[1] in train}
        for old, new in moves.items():
            old_key, (group, key) = old.split(".", 1)[1], new.split(".", 2)[1:]
            if old_key in taken:
                train.setdefault(group, {})[key] = taken[old_key]
    return moved


def migrated_override(override: str) -> str:
    """A recorded command line's override (a sweep's, continued) in today's layout: `train.eval_every=5` ->
    `train.eval.every=5`, `train.compile=true` -> `train.compile.enabled=true`; any other as it is. A recorded
    override is of its own version's layout: today's `train.compile.mode=...` is never moved again."""
    prefix = override[: len(override) - len(override.lstrip("+~"))]
    key, equals, value = override[len(prefix):].partition("=")
    home = new_home(key)
    return f"{prefix}{home}{equals}{value}" if home else override
