"""What ampctl advise reads back from the records its instruments wrote: the fp32 inspection's gradients, each
converted layer's loss from an inspection in that mode, the comparison's row for each mode, the model in a line."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Optional

from ampctl import io, run_files
from ampctl.studies.advising.advice import GradientEvidence, LayerLoss, ModeEvidence


def layer_losses(inspect_dir: Path, mode: str) -> tuple[Optional[list[LayerLoss]], str]:
    """Per converted layer, the operand its format loses most of (saturated + flushed), from an inspection in that
    mode: its block-scale table (MX) or its FP8 tensorwise table."""
    data = json.loads((inspect_dir / f"{run_files.INSPECTION}.json").read_text())
    for key, measured_by in (("block_scales", f"{mode} (by its block scales)"),
                             ("fp8_tensorwise", f"{mode} (by its tensorwise scale)")):
        rows = data.get(key)
        if rows:
            return [_worst_operand(row) for row in rows], measured_by
    return None, ""



def _worst_operand(row: dict) -> LayerLoss:
    shares = {role: (row.get(f"{role}_saturated") or 0.0) + (row.get(f"{role}_flushed") or 0.0)
              for role in ("activation", "weight", "gradient")}
    role = max(shares, key=shares.__getitem__)
    return LayerLoss(row["layer"], role, shares[role])



def model_facts(calibration: dict, inspect_dir: Optional[Path]) -> str:
    """The model in a line: parameters and FLOPs (the calibration run's), its leaf layers by type (inspect's, where
    it ran)."""
    flops = calibration.get("model_flops_per_step")
    mfu = calibration.get("mfu")
    parameters, flop = io.si_prefixed(calibration["parameters"]), io.si_prefixed(flops or 0)
    layers = ""
    if inspect_dir is not None:
        rows = json.loads((inspect_dir / f"{run_files.INSPECTION}.json").read_text())["rows"]
        types = Counter(dict((r["layer"], r.get("type", "?")) for r in rows).values())
        layers = (f"; {io.count_of(sum(types.values()), 'leaf layer')} ("
                  + ", ".join(f"{n} {name}" for name, n in types.most_common(4)) + (", ..." if len(types) > 4 else "")
                  + ")")
    return (f"{''.join(parameters)} parameters" + (f", {flop[0]} {flop[1]}FLOP a step" if flops else "") + layers
            + f"; fp32 steps {io.milliseconds(calibration['median_step_time_ms'])} ms here"
            + (f" ({mfu:.1%} MFU)" if mfu else ""))



def gradient_evidence(inspect_dir: Path) -> Optional[GradientEvidence]:
    """From ranges.json: the largest true gradient, what fp16 flushes at 2^16, the layers whose activations
    exceed fp16's range."""
    data = json.loads((inspect_dir / f"{run_files.INSPECTION}.json").read_text())
    summary = {row["kind"]: row for row in data["summary"]}
    grads = [summary[k]["max_abs"] for k in ("activation_grad", "weight_grad") if k in summary]
    if not grads:
        return None
    overflowing = tuple(dict.fromkeys(r["layer"] for r in data["rows"]
                                      if r["kind"] == "activation" and (r.get("fp16_overflow") or 0) > 0))
    flushed = summary.get("activation_grad", {}).get("fp16_to_zero_scaled") or 0.0
    return GradientEvidence(max(grads), flushed, overflowing)



def mode_evidence(compare_dir: Optional[Path], skipped: dict[str, str], not_compared: list[str] = ()
                  ) -> list[ModeEvidence]:
    """Every mode's row of comparison.json, and the modes compare did not run (with its reason). Without a
    comparison (compare_dir None), the modes that would have been compared, with nothing measured."""
    evidence = [ModeEvidence(mode, skipped=reason) for mode, reason in skipped.items()]
    record = None if compare_dir is None else compare_dir / f"{run_files.COMPARISON}.json"
    if record is None or not record.is_file():
        return [*(ModeEvidence(mode) for mode in not_compared), *evidence]
    data = json.loads(record.read_text())
    skipped_there = {mode: reason for mode, reason in data.get("skipped", {}).items() if mode not in skipped}
    evidence += [ModeEvidence(mode, skipped=reason) for mode, reason in skipped_there.items()]
    for row in data["rows"]:
        if row["precision"] in skipped or row["precision"] in skipped_there:
            continue
        if row.get("status") != "ok":
            evidence.append(ModeEvidence(row["precision"], failed=str(row.get("status"))))
            continue
        evidence.append(ModeEvidence(
            row["precision"], row.get("speedup"), row.get("speedup_low"), row.get("speedup_high"), row.get("parity"),
            row.get("eval_loss_delta"), row.get("eval_loss_delta_interval"), row.get("seeds") or 0,
            row.get("peak_memory_mib")))
    return evidence
