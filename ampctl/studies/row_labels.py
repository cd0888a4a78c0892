"""The row labels of a study that runs a mode more than one way: "bf16", "bf16+compile", "fp32+ac",
"bf16+compile+ac". A suffix appears only when the study runs both ways (the settings named in its list), so a
label alone says what differs between rows; parse() reads one back (ampctl advise turns its choice into a
config)."""

from __future__ import annotations

from dataclasses import dataclass

COMPILE, CHECKPOINTING = "+compile", "+ac"


def label(mode: str, compiled: bool, checkpointed: bool, *, both_compiled: bool, both_checkpointed: bool) -> str:
    return (mode + (COMPILE if compiled and both_compiled else "")
            + (CHECKPOINTING if checkpointed and both_checkpointed else ""))


@dataclass(frozen=True)
class Variant:
    mode: str
    compiled: bool = False  # True where the label says +compile (False: eager, or not said)
    checkpointed: bool = False

    def overrides(self) -> list[str]:
        """The train settings the label stands for, beyond precision=<mode>."""
        return [*(["train.compile=true"] if self.compiled else []),
                *(["train.activation_checkpointing=true"] if self.checkpointed else [])]


def parse(row_label: str) -> Variant:
    mode, checkpointed = (row_label[:-len(CHECKPOINTING)], True) if row_label.endswith(CHECKPOINTING) \
        else (row_label, False)
    mode, compiled = (mode[:-len(COMPILE)], True) if mode.endswith(COMPILE) else (mode, False)
    return Variant(mode, compiled, checkpointed)
