"""The row labels of a study that runs a mode more than one way: "bf16", "bf16+compile", "fp32+ac",
"bf16+compile+ac", "bf16_true+adamw_8bit". A suffix appears only when the study runs both ways (the settings named
in its list), so a label alone says what differs between rows; parse() reads one back (ampctl advise turns its
choice into a config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

COMPILE, CHECKPOINTING = "+compile", "+ac"
# advise's: a mode with the layers ampctl diff's repair raised (studies/advising/advise_repair.py)
REPAIRED = "+repaired"


def label(mode: str, compiled: bool, checkpointed: bool, *, both_compiled: bool, both_checkpointed: bool,
          optimizer: Optional[str] = None) -> str:
    """optimizer: named where the study runs several (compare.optimizers)."""
    return (mode + (f"+{optimizer}" if optimizer else "") + (COMPILE if compiled and both_compiled else "")
            + (CHECKPOINTING if checkpointed and both_checkpointed else ""))


@dataclass(frozen=True)
class Variant:
    mode: str
    compiled: bool = False  # True where the label says +compile (False: eager, or not said)
    checkpointed: bool = False
    optimizer: Optional[str] = None  # where the label names one
    repaired: bool = False  # its rules are the repair's (advise's preparation of the label holds them)

    def overrides(self) -> list[str]:
        """The train settings the label stands for, beyond precision=<mode>."""
        return [*([f"optimizer={self.optimizer}"] if self.optimizer else []),
                *(["train.compile.enabled=true"] if self.compiled else []),
                *(["train.activation_checkpointing=true"] if self.checkpointed else [])]


def parse(row_label: str) -> Variant:
    repaired = row_label.endswith(REPAIRED)
    row_label = row_label.removesuffix(REPAIRED)
    mode, checkpointed = (row_label[:-len(CHECKPOINTING)], True) if row_label.endswith(CHECKPOINTING) \
        else (row_label, False)
    mode, compiled = (mode[:-len(COMPILE)], True) if mode.endswith(COMPILE) else (mode, False)
    mode, _, optimizer = mode.partition("+")  # a mode's name has no +
    return Variant(mode, compiled, checkpointed, optimizer or None, repaired)
