"""ampctl advise end to end on the mlp with a small budget: what it writes, that the config it writes runs as
written, and that its choice agrees with an independent `ampctl compare` of the same modes (noise allowing: the
advised mode is fp32, or one that compare finds not slower than fp32 and not differing from it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "compare.rounds=2",
         "compare.warmup_steps=2", "telemetry.profile_cpu_memory=false"]


def ampctl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampctl", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)


def test_advise_writes_the_evidence_and_a_config_that_runs_and_agrees_with_an_independent_compare(tmp_path):
    advised = ampctl("advise", *SMALL, "advise.budget=30s", "hydra.run.dir=advice", cwd=tmp_path)
    assert advised.returncode == 0, advised.stderr[-3000:]
    out = tmp_path / "advice"
    record = json.loads((out / "advice.json").read_text())
    advice = record["advice"]
    assert {"inspect", "calibration", "advice.md", "advised.yaml"} <= {p.name for p in out.iterdir()}
    assert f"advice (goal=speed): precision={advice['mode']}" in advised.stdout
    assert advice["reasons"] and "run it: ampctl train -cd" in advised.stdout
    evidence = {e["mode"]: e for e in record["evidence"]}
    assert evidence.keys() >= {"fp32"} and set(advice["rejected"]) == evidence.keys() - {"fp32", advice["mode"]}

    written = (out / "advice.md").read_text()
    (out / "advice.md").unlink()
    rendered = ampctl("report", str(out), cwd=tmp_path)  # from advice.json, again
    assert rendered.returncode == 0 and (out / "advice.md").read_text() == written, rendered.stderr

    trained = ampctl("train", "-cd", str(out), "-cn", "advised", "train.steps=3", "hydra.run.dir=run", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["precision_choice"] == advice["mode"] and summary["recipe"] == "mlp" and summary["steps"] == 3

    compared = [e["mode"] for e in record["evidence"] if e["skipped"] is None and e["failed"] is None]
    if len(compared) > 1:
        check = ampctl("compare", *SMALL, "train.steps=60", "compare.seeds=3",
                       f"compare.precisions=[{','.join(compared)}]", "hydra.run.dir=independent", cwd=tmp_path)
        assert check.returncode == 0, check.stderr[-3000:]
        rows = {r["precision"]: r for r in json.loads((tmp_path / "independent" / "comparison.json").read_text())["rows"]}
        if advice["mode"] != "fp32":  # not slower than fp32 there, and not differing from it
            row = rows[advice["mode"]]
            assert row["speedup_high"] >= 1.0 and row["parity"] != "differs", row
        else:  # no candidate there is clearly faster and shown to match (a margin for the machine's noise)
            assert not [r for r in rows.values() if r["precision"] != "fp32" and r.get("speedup_low") is not None
                        and r["speedup_low"] > 1.25 and r["parity"] == "matches"], rows


def test_ctrl_c_during_the_comparison_leaves_the_advice_of_what_was_measured(tmp_path):
    import signal
    import time

    out = tmp_path / "advice"
    process = subprocess.Popen([sys.executable, "-m", "ampctl", "advise", *SMALL, "advise.budget=1h",
                                "compare.precisions=[fp32,fp16]", f"hydra.run.dir={out}"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 300
    while not any(p.read_text().count("\n") >= 5 for p in (out / "compare").rglob("metrics.jsonl")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=180)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "ampctl advise: interrupted" in stderr
    record = json.loads((out / "advice.json").read_text())
    assert record["partial"].startswith("interrupted during the comparison")
    assert "partial: interrupted" in stdout and (out / "advised.yaml").is_file()
