"""An adversarial sweep of ampctl as a user can break it: bad values in every command, runs and results in the
way, damaged records, kills and signals. Each case runs `python -m ampctl ...` in a fresh directory that also
holds a finished run (the witness: nothing a case does may change it, unless the case continues it), and is
classified:

  ok          refused in one line with exit 2 and nothing left behind, or run as asked (exit 0)
  defect      a refusal of more than one line, a wrong exit code, a directory left behind
  data loss   a file that existed before the case changed or vanished, rows duplicated or missing
  traceback   a Python traceback

    python benchmarks/adversarial_sweep.py [--jobs 2] [--only SUBSTRING] [--out results.json]

Prints one line per case that is not ok, then the counts. 309 cases; about 12 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
BASE = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.console=quiet",
        "telemetry.profile_cpu_memory=false"]
TINY = [*BASE, "train.steps=2"]
SIGNALLED_STEPS = 4000  # a run a signal or a kill reaches in its middle
COMMAND_TINY = {
    "train": TINY,
    "compare": [*TINY, "compare.precisions=[fp32,bf16]", "compare.rounds=1", "compare.warmup_steps=0"],
    "inspect": [*TINY, "inspect.steps=1"],
    "memory": [*TINY, "memory.precisions=[fp32]"],
}


@dataclass
class Case:
    name: str
    command: list[str]  # after `python -m ampctl`
    expect: str = "refused"  # refused | ok | either
    setup: Optional[Callable[[Path], None]] = None
    during: Optional[Callable[[subprocess.Popen, Path], None]] = None  # a kill or a signal while it runs
    check: Optional[Callable[[Path, subprocess.CompletedProcess], Optional[str]]] = None  # a data problem, or None
    continues_witness: bool = False  # the case may write into the witness run (a resume of it)


@dataclass
class Outcome:
    name: str
    verdict: str
    detail: str = ""
    rc: Optional[int] = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


# --- the witness: a finished run every case's directory holds -------------------------------------------------


def make_witness(root: Path) -> Path:
    witness = root / "witness"
    done = subprocess.run([sys.executable, "-m", "ampctl", "train", *BASE, "train.steps=6", "train.checkpoint.every=3",
                           "train.checkpoint.keep=5", f"hydra.run.dir={witness}"], capture_output=True, text=True,
                          cwd=root)
    assert done.returncode == 0, done.stderr
    return witness


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def steps_of(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


# --- running one case -----------------------------------------------------------------------------------------


def run_case(case: Case, witness: Path, timeout: float) -> Outcome:
    cwd = Path(tempfile.mkdtemp(prefix="adv-"))
    start = time.monotonic()
    try:
        shutil.copytree(witness, cwd / "run")
        if case.setup:
            case.setup(cwd)
        before_all = snapshot(cwd)
        env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
        argv = [sys.executable, *case.command] if case.command[0] == "-c" else \
            [sys.executable, "-m", "ampctl", *case.command]
        process = subprocess.Popen(argv, cwd=cwd, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        if case.during:
            case.during(process, cwd)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            return Outcome(case.name, "defect", f"still running after {timeout:.0f} s", None,
                           time.monotonic() - start)
        result = subprocess.CompletedProcess(case.command, process.returncode, out, err)
        return classify(case, cwd, before_all, result, time.monotonic() - start)
    finally:
        shutil.rmtree(cwd, ignore_errors=True)


def classify(case: Case, cwd: Path, before: dict[str, str], result: subprocess.CompletedProcess,
             seconds: float) -> Outcome:
    def outcome(verdict: str, detail: str = "") -> Outcome:
        return Outcome(case.name, verdict, detail, result.returncode, seconds)

    if "Traceback (most recent call last)" in result.stderr + result.stdout:
        last = [line for line in result.stderr.splitlines() if line.strip()]
        return outcome("traceback", last[-1][:200] if last else "")
    after = snapshot(cwd)
    changed = [name for name, digest in before.items() if after.get(name) != digest
               and not (case.continues_witness and name.startswith("run/"))]
    if changed:
        return outcome("data loss", f"changed or removed: {', '.join(changed[:4])}")
    if case.check:
        problem = case.check(cwd, result)
        if problem:
            return outcome("data loss" if problem.startswith("data:") else "defect", problem)
    refused = result.returncode == 2
    if refused and case.expect in ("refused", "either"):
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        if len(lines) != 1 or not lines[0].startswith("ampctl"):
            return outcome("defect", f"refusal in {len(lines)} lines: {' / '.join(lines)[:200]}")
        left = sorted(set(after) - set(before))
        if left:
            return outcome("defect", f"refused but left {', '.join(left[:3])}")
        return outcome("ok", lines[0][:160])
    if result.returncode == 0 and case.expect in ("ok", "either"):
        return outcome("ok", "ran")
    if case.expect == "killed" and result.returncode == -signal.SIGKILL:
        return outcome("ok", "killed")
    if case.expect == "signal" and result.returncode > 128:
        lines = [line for line in result.stderr.splitlines() if line.strip() and "stopping after" not in line]
        return outcome("ok" if lines and "Traceback" not in result.stderr else "defect", " / ".join(lines)[:160])
    tail = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()][-1:]
    return outcome("defect", f"exit {result.returncode} (expected {case.expect}): {' '.join(tail)[:200]}")


# --- the cases ------------------------------------------------------------------------------------------------

# key -> bad values, for every command that composes train's config
SHARED_BAD = {
    "train.steps": ["0", "-1", "1.5", "abc", "null", "9223372036854775808", "${oops}"],
    "train.log_every": ["0", "-3", "abc"],
    "train.checkpoint.every": ["0", "-5", "x"],
    "train.grad_accum_steps": ["0", "-1", "1.5"],
    "train.seed": ["abc", "1e30", "[1]"],
    "train.clip_grad_norm": ["-1", "abc", "nan"],
    "train.lr.warmup_steps": ["-1", "abc"],
    "train.console": ["foo", "1"],
    "train.compile": ["2", "maybe"],
    "train.timing_warmup_steps": ["-1"],
    "scaler.init_scale": ["0", "-1", "nan", "inf", "abc"],
    "scaler.growth_factor": ["0.5", "-2", "abc"],
    "scaler.backoff_factor": ["2", "0", "-1"],
    "scaler.growth_interval": ["0", "-1", "1.5"],
    "optimizer.lr": ["0", "-1", "nan", "abc"],
    "optimizer.betas": ["[1,2]", "[0.9]", "abc"],
    "optimizer.weight_decay": ["-1"],
    "optimizer.fused": ["maybe", "2"],
    "recipe.hidden": ["0", "-1", "2.5", "abc"],
    "recipe.depth": ["0", "x"],
    "recipe.batch_size": ["0", "-1", "1e11"],
    "recipe.num_classes": ["1", "0"],
    "recipe.norm": ["foo", "1"],
    "telemetry.profile_cpu_memory": ["2", "maybe"],
    "telemetry.ranges_every": ["0", "-1"],
    "device": ["foo", "cuda", "cuda:7"],
    "precision": ["foo", "fp99"],
    "scaler": ["foo"],
    "optimizer": ["foo"],
    "recipe": ["foo"],
    "distributed": ["foo"],
    "hydra.run.dir": ["", "/proc/adv/run", "afile", "run"],
    "+train.steps": ["3"],
    "train.foo": ["1"],
    "+optimizer.foo": ["1"],
    "optimizer._target_": ["os.getcwd", "no.such.Optimizer"],
    "recipe._target_": ["os.getcwd", "no.such.Recipe", "argparse.Namespace"],
}
TRAIN_ONLY_BAD = {
    "train.checkpoint.keep": ["-1", "abc"],
    "train.eval.every": ["0", "-1"],
    "train.checkpoint.save_top_k": ["-1", "abc"],
    "train.profile": ["0", "-1", "1000"],
    "train.cluster.preempt_signal": ["SIGKILL", "foo"],
    "train.checkpoint.every_s": ["0", "-1"],
    "resume": ["/nonexistent", "afile", "empty_dir", "run/metrics.jsonl"],
    "logger": ["foo"],
    "logger.csv.file": ["''", "/tmp/adv-elsewhere.csv", "../x.csv", "metrics.jsonl", ".hydra"],
    "logger.tensorboard.log_dir": ["/proc/tb", "../tb", "checkpoints"],
    "logger.mlflow.tracking_uri": ["bogus://x", "sqlite:///afile/db.sqlite"],
    "recipe.corpus": ["/nonexistent.txt"],
    "guard.max_consecutive_skips": ["-1", "abc"],
}
COMMAND_BAD = {
    "compare": {"compare.precisions": ["[foo]", "[]", "fp32"], "compare.rounds": ["0", "-1", "abc"],
                "compare.seeds": ["0", "-2"], "compare.warmup_steps": ["-1", "abc"], "distributed": ["ddp"],
                "compare.activation_checkpointing": ["[maybe]"]},
    "inspect": {"inspect.steps": ["0", "-1", "abc"], "inspect.loss_scale": ["3", "0", "-4", "abc"],
                "distributed": ["ddp"]},
    "memory": {"memory.precisions": ["[foo]", "[]"], "memory.budget": ["abc", "-1GB", "0"], "distributed": ["ddp"]},
}
# overrides whose composition needs their group chosen first
PREREQUISITES = {"logger.csv.file": ["logger=csv"], "logger.tensorboard.log_dir": ["logger=tensorboard"],
                 "logger.mlflow.tracking_uri": ["logger=mlflow"], "recipe.corpus": ["recipe=gpt"]}


def files_in_the_way(cwd: Path) -> None:
    (cwd / "afile").write_text("a user's file\n")
    (cwd / "empty_dir").mkdir()


def bad_value_cases() -> list[Case]:
    cases = []
    for command in ("train", "compare", "inspect", "memory"):
        # train meets every bad value; the others the first of each shared key, and every one of their own
        shared = SHARED_BAD if command == "train" else {k: v[:1] for k, v in SHARED_BAD.items()}
        table = {**shared, **(TRAIN_ONLY_BAD if command == "train" else COMMAND_BAD[command])}
        for key, values in table.items():
            for value in values:
                run_dir = [] if key == "hydra.run.dir" else ["hydra.run.dir=out"]
                base = [o for o in COMMAND_TINY[command] if not (key == "train.steps" and o.startswith("train.steps"))
                        and not (key == "recipe.corpus" and o.startswith("recipe"))]
                override = f"{key}={value}"
                cases.append(Case(f"{command} {override}", [command, *base, *PREREQUISITES.get(key, []), override,
                                                            *run_dir], expect="either", setup=files_in_the_way))
    return cases


def finished_into(cwd: Path) -> None:
    files_in_the_way(cwd)


def integrity_cases() -> list[Case]:
    cases = []
    # every command into a finished run, into each other's results, into the current directory
    for command in ("train", "compare", "inspect", "memory"):
        for extra in ([], ["resume="], ["resume=null"]) if command == "train" else ([],):
            cases.append(Case(f"{command} into a finished run {' '.join(extra)}",
                              [command, *COMMAND_TINY[command], "hydra.run.dir=run", *extra]))
        cases.append(Case(f"{command} hydra.run.dir=''", [command, *COMMAND_TINY[command], "hydra.run.dir="]))
        cases.append(Case(f"{command} into a file", [command, *COMMAND_TINY[command], "hydra.run.dir=afile"],
                          setup=files_in_the_way))
    cases.append(Case("train -m hydra.sweep.dir=''", ["train", "-m", *TINY, "train.seed=1,2", "hydra.sweep.dir="]))
    cases.append(Case("train -m into a run", ["train", "-m", *TINY, "train.seed=1,2", "hydra.sweep.dir=run"]))
    # the Python API: twice into one directory, the current directory, a missing config dir
    api = ("import sys, ampctl\ntry:\n    ampctl.{fn}({args!r}, {where}=r'{dir}')\n"
           "except ampctl.errors.UsageError as e:\n"
           "    print(f'ampctl api: error: {{e}}', file=sys.stderr); sys.exit(2)")
    for fn, where in (("train", "run_dir"), ("inspect", "out_dir")):
        for target in ("run", ""):
            script = api.format(fn=fn, args=COMMAND_TINY[fn], where=where, dir=target)
            cases.append(Case(f"api {fn} into {target or 'the current directory'}",
                              ["-c", script], expect="refused"))
    # resume: another run's checkpoint, missing or garbled checksums, a truncated or bit-flipped checkpoint
    for damage in ("copied", "no checksum", "garbled checksum", "truncated", "bit flip", "no checksum + bit flip",
                   "garbled identity", "garbled trackers.json", "metrics cut in row 2", "summary garbled"):
        cases.append(Case(f"resume=auto after: {damage}", ["train", *TINY, "train.steps=8", "hydra.run.dir=run",
                                                            "resume=auto"], expect="either",
                          setup=damaging(damage), check=resumed_cleanly(damage), continues_witness=True))
    # kills and signals at several points of a run, then resume=auto: every step once
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGKILL):
        for after_s in (0.2, 1.0, 2.0):  # the run takes about 5 s
            cases.append(Case(f"{signal.Signals(signum).name} after {after_s} s, then resume=auto",
                              ["train", *BASE, f"train.steps={SIGNALLED_STEPS}", "train.log_every=1",
                               "train.checkpoint.every=50",
                               "hydra.run.dir=new"], expect="signal" if signum != signal.SIGKILL else "killed",
                              during=signalling(signum, after_s), check=resumes_every_step_once))
    # report on damaged records
    for damage in ("summary garbled", "metrics garbled", "overrides garbled", "loss a string", "duplicated row",
                   "missing rows", "empty dir", "nonexistent"):
        cases.append(Case(f"report after: {damage}", ["report", "run" if damage != "nonexistent" else "nope"],
                          expect="either", setup=damaging(damage), continues_witness=True,
                          check=report_names(damage)))
    return cases


def damaging(damage: str) -> Callable[[Path], None]:
    def damage_it(cwd: Path) -> None:
        run = cwd / "run"
        newest = run / "checkpoints" / "step_00000006.pt"
        files_in_the_way(cwd)
        if damage == "copied":
            other = cwd / "other"
            subprocess.run([sys.executable, "-m", "ampctl", "train", *TINY, "train.steps=7", "train.seed=9",
                            f"hydra.run.dir={other}"], capture_output=True, cwd=cwd,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
            for path in (other / "checkpoints").glob("step_00000007.pt*"):
                shutil.copy(path, run / "checkpoints")
            shutil.rmtree(other)
        elif damage in ("no checksum", "no checksum + bit flip"):
            Path(f"{newest}.sha256").unlink()
            if "bit flip" in damage:
                data = bytearray(newest.read_bytes())
                data[len(data) // 2] ^= 1
                newest.write_bytes(bytes(data))
        elif damage == "garbled checksum":
            Path(f"{newest}.sha256").write_bytes(b"\xff\xfe\x00")
        elif damage == "truncated":
            newest.write_bytes(newest.read_bytes()[:999])
        elif damage == "bit flip":
            data = bytearray(newest.read_bytes())
            data[len(data) // 3] ^= 4
            newest.write_bytes(bytes(data))
        elif damage == "garbled identity":
            (run / "identity.json").write_bytes(b"{not json")
        elif damage == "garbled trackers.json":
            (run / "trackers.json").write_bytes(b"\x00")
        elif damage == "metrics cut in row 2":
            lines = (run / "metrics.jsonl").read_text().splitlines()
            (run / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:10])
        elif damage in ("summary garbled",):
            (run / "summary.json").write_text("{")
        elif damage == "metrics garbled":
            (run / "metrics.jsonl").write_text("{oops\n" + (run / "metrics.jsonl").read_text())
        elif damage == "overrides garbled":
            (run / ".hydra" / "overrides.yaml").write_text("- [\n")
        elif damage == "loss a string":
            lines = (run / "metrics.jsonl").read_text().splitlines()
            lines[1] = json.dumps({**json.loads(lines[1]), "loss": "abc"})
            (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        elif damage == "duplicated row":
            lines = (run / "metrics.jsonl").read_text().splitlines()
            (run / "metrics.jsonl").write_text("\n".join(lines + lines[2:3]) + "\n")
        elif damage == "missing rows":
            lines = (run / "metrics.jsonl").read_text().splitlines()
            (run / "metrics.jsonl").write_text("\n".join(lines[:2] + lines[4:]) + "\n")
        elif damage == "empty dir":
            shutil.rmtree(run)
            run.mkdir()
    return damage_it


def resumed_cleanly(damage: str) -> Callable[[Path, subprocess.CompletedProcess], Optional[str]]:
    """A resume that ran continued its own run: every step once, from 1 to 8 (rows cut on disk before it: said,
    and the others kept), and named what it passed over."""
    def check(cwd: Path, result: subprocess.CompletedProcess) -> Optional[str]:
        if result.returncode != 0:
            return None
        steps = steps_of(cwd / "run")
        if damage == "metrics cut in row 2":
            return None if steps == [1, 7, 8] and "step(s) 2-6 missing" in result.stdout else \
                f"the cut rows were not named (steps {steps})"
        if steps != list(range(1, 9)):
            return f"data: steps {steps} after the resume"
        if damage in ("copied", "bit flip", "no checksum", "no checksum + bit flip", "truncated",
                      "garbled checksum") and "passed over" not in result.stdout:
            return f"the damaged checkpoint was not named ({damage})"
        return None
    return check


def signalling(signum: int, after_s: float) -> Callable[[subprocess.Popen, Path], None]:
    def send(process: subprocess.Popen, cwd: Path) -> None:
        metrics = cwd / "new" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not metrics.is_file() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.01)
        time.sleep(after_s)
        if process.poll() is None:
            os.kill(process.pid, signum)
    return send


def resumes_every_step_once(cwd: Path, result: subprocess.CompletedProcess) -> Optional[str]:
    resumed = subprocess.run([sys.executable, "-m", "ampctl", "train", *BASE, f"train.steps={SIGNALLED_STEPS}",
                              "train.log_every=1",
                              "train.checkpoint.every=50", "hydra.run.dir=new", "resume=auto"], capture_output=True,
                             text=True, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})
    if "Traceback" in resumed.stderr:
        return "the resume ended in a traceback"
    if resumed.returncode != 0:
        return f"the resume exited {resumed.returncode}: {resumed.stderr.strip()[-160:]}"
    steps = steps_of(cwd / "new")
    if result.returncode == 0:
        return "the signal came after the run's end: the case measured nothing"
    if steps == list(range(1, SIGNALLED_STEPS + 1)):
        return None
    return f"data: steps after the resume: {len(steps)} rows, {len(set(steps))} distinct"


def report_names(damage: str) -> Callable[[Path, subprocess.CompletedProcess], Optional[str]]:
    def check(cwd: Path, result: subprocess.CompletedProcess) -> Optional[str]:
        if damage in ("duplicated row", "missing rows") and "warning:" not in result.stdout:
            return f"report said nothing of the {damage}"
        if damage in ("summary garbled", "metrics garbled", "overrides garbled", "loss a string", "empty dir",
                      "nonexistent") and result.returncode == 0:
            return f"report rendered a damaged record ({damage}) without a word"
        return None
    return check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default="")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cases = [c for c in bad_value_cases() + integrity_cases() if args.only in c.name]
    root = Path(tempfile.mkdtemp(prefix="adv-witness-"))
    witness = make_witness(root)
    print(f"{len(cases)} cases, {args.jobs} at a time", flush=True)
    outcomes: list[Outcome] = []
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for outcome in pool.map(lambda c: run_case(c, witness, args.timeout), cases):
            outcomes.append(outcome)
            if outcome.verdict != "ok":
                print(f"{outcome.verdict:9} | {outcome.name} | {outcome.detail}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    counts = {v: sum(o.verdict == v for o in outcomes) for v in ("ok", "defect", "data loss", "traceback")}
    accepted = [o.name for o in outcomes if o.verdict == "ok" and o.detail == "ran" and
                next(c for c in cases if c.name == o.name).expect == "either"]
    print(f"accepted as valid ({len(accepted)}; each ran to its end with nothing touched): {'; '.join(accepted)}")
    print(f"{len(outcomes)} cases: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    if args.out:
        args.out.write_text(json.dumps([o.__dict__ for o in outcomes], indent=1) + "\n")
    sys.exit(0 if counts["data loss"] == counts["traceback"] == 0 else 1)


if __name__ == "__main__":
    main()
