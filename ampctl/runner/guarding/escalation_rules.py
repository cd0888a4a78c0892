"""The rules guard.on_trip=escalate scheduled for a run (runner/guarding/escalation.py makes them): read from the run's
escalations.jsonl, and put into a config before its mode's own. A resume at a step applies the last row's at or
before it (runner/resume.py); a run's summary lists the rows."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ampctl import run_files
from ampctl.conf.precision_schema import LayerRule


def recorded(run_dir: Path) -> list[dict[str, Any]]:
    """escalations.jsonl's rows, in order (a line that is not a row, cut by a kill, is passed over)."""
    path = run_dir / run_files.ESCALATIONS
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("rules"), list):
            rows.append(row)
    return rows


def rules_in(row: dict[str, Any]) -> list[LayerRule]:
    """The rules a row puts in force."""
    return [LayerRule.of(rule) for rule in row["rules"]]


def resume_rules(run_dir: Path, step: int) -> list[LayerRule]:
    """The escalation rules in force at `step`: the last row's at or before it (none: no escalation)."""
    rows = [row for row in recorded(run_dir) if row["step"] <= step]
    return rules_in(rows[-1]) if rows else []


def with_rules(config: dict[str, Any], rules: list[LayerRule]) -> dict[str, Any]:
    """A resolved config with the escalation rules before its mode's own: the same config again when they are there
    already (a checkpoint written after the escalation), a mode's rule naming only an escalated layer replaced."""
    if not rules:
        return config
    escalated = {rule.match for rule in rules}
    own = [rule for rule in config["precision"].get("rules") or []
           if not (rule.get("type") is None and rule.get("match") in escalated)]
    typed = [asdict(rule) for rule in rules]  # every key, as the schema has it
    return {**config, "precision": {**config["precision"], "rules": [*typed, *own]}}
