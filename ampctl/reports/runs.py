"""Reading run directories back: what `ampctl train` left in each (summary, every step, overrides, error)."""

from __future__ import annotations

import errno
import fcntl
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional

from ampctl import run_files
from ampctl.errors import UsageError

# summary.json's measured figures: null there stands for a non-finite value (JSON has no NaN), read back as NaN
SUMMARY_FIGURES = ("final_loss", "tail_loss", "final_loss_scale", "median_step_time_ms", "samples_per_s",
                   "tokens_per_s")
# what every summary ampctl writes holds, and the reports read (runner/run.py)
SUMMARY_REQUIRED = ("steps", "final_loss", "skipped_total", "final_loss_scale", "median_step_time_ms")


@dataclass
class RunRecord:
    path: Path
    summary: Optional[dict]
    metrics: list[dict] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    error: Optional[str] = None
    running_pid: Optional[int] = None  # the process recording into it now

    @property
    def status(self) -> str:
        """ok (a summary), running or interrupted (no summary, no error), or failed."""
        if self.summary is not None:
            return "ok"
        if self.unfinished:
            return "running" if self.running_pid is not None else "interrupted"
        return "failed"

    @property
    def why_not_ok(self) -> Optional[str]:
        return self.unfinished or self.error

    @property
    def unfinished(self) -> Optional[str]:
        """Why a run without a summary has none, when not an error: it is running, or it was interrupted (and how
        it continues)."""
        where = self.unfinished_where
        if where is None or self.running_pid is not None:
            return where
        if self.has_checkpoint:
            return f"{where}; continue it with: ampctl train resume={self.path}"
        first = "" if not self.metrics else ", before its first checkpoint"
        if (self.path / run_files.IDENTITY).is_file():  # its own config is in its identity: it starts over with it
            return f"{where}{first}; start it over with: ampctl train resume=auto hydra.run.dir={self.path}"
        return f"{where}{first}: nothing to continue (run it again)"

    @property
    def unfinished_where(self) -> Optional[str]:
        """`interrupted at step 12`, `running (pid 7), at step 3`; None for a run that ended."""
        if self.summary is not None or (self.path / run_files.ERROR).is_file():
            return None
        at = f"at step {self.metrics[-1]['step']}" if self.metrics else "before its first step"
        return f"running (pid {self.running_pid}), {at}" if self.running_pid is not None else f"interrupted {at}"

    @property
    def has_checkpoint(self) -> bool:
        return any((self.path / run_files.CHECKPOINTS).glob("step_*"))

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def job(self) -> str:
        """The job number of a multirun job directory (`3_key=value,...`), else the directory's name."""
        head = self.name.split("_", 1)[0]
        return head if head.isdigit() else self.name

    @property
    def failed(self) -> bool:
        return self.summary is None

    def override_values(self) -> dict[str, str]:
        """`key=value` overrides of this run as a dict (Hydra's `+key`/`~key` prefixes kept in the key)."""
        return dict(o.split("=", 1) for o in self.overrides if "=" in o)


def is_run_dir(path: Path) -> bool:
    return any((path / name).exists() for name in (run_files.SUMMARY, run_files.METRICS, run_files.ERROR))


def load_run(path: Path) -> RunRecord:
    """A run directory's records. A summary or row that is not whole raises UsageError naming the file (and
    line): a report from part of a record would be wrong without saying so."""
    summary = read_summary(path / run_files.SUMMARY)
    metrics = read_rows(path / run_files.METRICS)
    overrides_path = path / ".hydra" / "overrides.yaml"
    overrides = read_overrides(overrides_path) if overrides_path.is_file() else []
    error_path = path / run_files.ERROR
    error = error_path.read_text().strip() if error_path.is_file() else None
    return RunRecord(path, summary, metrics, overrides, error, running_pid=holder_pid(path))


def read_overrides(path: Path) -> list[str]:
    """Hydra's overrides.yaml: a list of `key=value` texts (UsageError naming the file when it is not one)."""
    import yaml

    try:
        overrides = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UsageError(f"{path} cannot be read ({type(exc).__name__}): the run's overrides are lost; its config "
                         "is in config.yaml beside it") from None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise UsageError(f"{path} is not a list of overrides: the run's config is in config.yaml beside it")
    return overrides


def row_problems(rows: list[dict], through: int = 0) -> list[str]:
    """What a run's rows lack or repeat, in words: missing steps (up to the last row's, or `through`), steps
    recorded twice, steps out of order."""
    steps = [row["step"] for row in rows]
    problems = []
    if any(b < a for a, b in zip(steps, steps[1:])):
        problems.append("rows out of step order")
    seen, twice = set(), set()
    for step in steps:
        (twice if step in seen else seen).add(step)
    if twice:
        problems.append(f"step(s) {_ranges(sorted(twice))} recorded twice")
    missing = sorted(set(range(1, max([*steps, through]) + 1)) - seen)
    if missing:
        problems.append(f"step(s) {_ranges(missing)} missing")
    return problems


def _ranges(steps: list[int]) -> str:
    """[4, 5, 6, 9] -> '4-6, 9'."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    text = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans[:6])
    return text + (f" and {len(spans) - 6} more spans" if len(spans) > 6 else "")


def read_summary(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(summary, dict) or not isinstance(summary.get("steps"), int):
            raise ValueError("not an object with an integer 'steps'")
        missing = [key for key in SUMMARY_REQUIRED if key not in summary]
        if missing:
            raise ValueError(f"it lacks {', '.join(missing)}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not a whole summary ({exc}); the run's rows are in metrics.jsonl") from None
    summary.update({k: float("nan") for k in SUMMARY_FIGURES if k in summary and summary[k] is None})
    return summary


# the figures of a row (engine/telemetry.py's StepRecord): numbers, or null where a step has none
NUMERIC_FIELDS = ("loss", "loss_scale", "skipped_total", "grad_norm", "lr", "step_time_ms", "samples_per_s",
                  "tokens_per_s", "tflops", "mfu", "data_ms")


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows. A last line without its newline was cut by a kill and is passed over; any other
    line that is not a row with an integer step raises UsageError naming it."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines[:-1], start=1):  # lines[-1]: "" after the last newline, or a cut line
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a row with an integer 'step'")
            bad = next((k for k in NUMERIC_FIELDS if row.get(k) is not None and
                        (isinstance(row[k], bool) or not isinstance(row[k], (int, float)))), None)
            if bad is not None:
                raise ValueError(f"its {bad} is {row[bad]!r}, not a number")
        except ValueError as exc:
            raise UsageError(f"{path}:{number} is not a metrics row ({exc}); a run resumed in that directory sets "
                             "such lines aside") from None
        rows.append(row)
    return rows


# flock() where the file system has no locks: Lustre mounted without -o flock (ENOLCK), some FUSE and NFS set-ups
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


def flock_run_dir(handle: IO, flags: int, run_dir: Path) -> None:
    """fcntl.flock on run_dir's lock file; UsageError, in one line, where its file system cannot lock: the lock is
    what keeps a second run out of a running one's directory, and ampctl does not run without it."""
    try:
        fcntl.flock(handle, flags)
    except OSError as exc:
        if exc.errno not in _NO_LOCKS:
            raise
        raise UsageError(f"hydra.run.dir={run_dir}: its file system refuses file locks (flock: {exc.strerror}), "
                         "which keep a second run out of a running one's directory: choose a run directory on a "
                         "file system with locks (Lustre: mount with -o flock)") from None


def holder_pid(run_dir: Path) -> Optional[int]:
    """The pid of the ampctl run holding run_dir's lock now, or None (a killed run's lock is free)."""
    lock = run_dir / run_files.LOCK
    if not lock.is_file():
        return None
    with open(lock) as handle:
        try:
            flock_run_dir(handle, fcntl.LOCK_SH | fcntl.LOCK_NB, run_dir)
        except BlockingIOError:
            try:
                return int(lock.read_text().strip())
            except ValueError:
                return -1  # held, by a run that has not written its pid yet
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def find_runs(root: Path) -> list[RunRecord]:
    """The run directories directly under root (a multirun or compare directory), in numeric job order."""

    def order(path: Path) -> tuple[int, str]:
        head = path.name.split("_", 1)[0]
        return (int(head) if head.isdigit() else 1 << 30, path.name)

    return [load_run(p) for p in sorted((p for p in root.iterdir() if p.is_dir()), key=order) if is_run_dir(p)]
