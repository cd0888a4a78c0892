"""The one object that carries values between Hydra's callbacks and the rest of this process. Hydra calls a
command's callbacks (shell/checks.py, shell/sweep_callbacks.py) and then its task function in one process, but hands
the task nothing but its config: what the callbacks found reaches the task, and the router, through THIS_PROCESS
alone. Nothing else in ampctl holds a value between them (tests/unit/test_code_limits.py looks for module-level
containers changed in functions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from ampctl.interrupt import give_ctrl_c_back

if TYPE_CHECKING:  # annotations only: the plans module hands its plan over through this one
    from ampctl.reports.sweep_progress import JobsProgress
    from ampctl.shell.plan_kinds import Plan


@dataclass
class RunningSweep:
    """The sweep this process launched, from Hydra's on_multirun_start to its end (on_multirun_end, or the unfinished
    sweep's report when its launcher raised): its directory and what its start set, which its end undoes."""

    sweep_dir: Path
    watcher: Optional["JobsProgress"] = None  # the jobs' progress lines, where they run in processes of their own
    mask_before: Optional[set] = None  # the main thread's signal mask before a launcher's controller started

    def end(self) -> None:
        give_ctrl_c_back(self.mask_before)
        self.mask_before = None
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None


@dataclass
class ThisProcess:
    # the single run a check planned, and the directory Hydra makes for it: the task function takes the plan from
    # here instead of planning (resolving a resume) again; a Ctrl-C between Hydra making the directory and the task
    # starting leaves only Hydra's files there, which the router removes
    plan: Optional["Plan"] = None
    plan_dir: Optional[Path] = None
    sweep: Optional[RunningSweep] = None  # the sweep this process launched, until its end (its table on a stop)
    # the end of the start's uncollected imports, once the run is planned (processes.start_kept_out_of_collections)
    start_is_over: Optional[Callable[[], None]] = None
    # an earlier run's .hydra/ files in the planned directory, read before Hydra writes this command's over them: a
    # command that ends keeping nothing (refused, interrupted) puts them back (shell/outcomes.leave)
    earlier_hydra_files: dict[Path, bytes] = field(default_factory=dict)

    def keep_earlier_hydra_files(self, run_dir: Path) -> None:
        hydra_dir = run_dir / ".hydra"
        self.earlier_hydra_files = ({p: p.read_bytes() for p in hydra_dir.iterdir() if p.is_file()}
                                    if hydra_dir.is_dir() else {})

    def put_back_earlier_hydra_files(self) -> None:
        """What this process wrote over an earlier run's .hydra/ files, undone (where the directory is still there)."""
        earlier, self.earlier_hydra_files = self.earlier_hydra_files, {}
        for path, data in earlier.items():
            if path.parent.is_dir() and (not path.is_file() or path.read_bytes() != data):
                from ampctl import io

                io.atomic_write_bytes(path, data)

    def take_plan(self, output_dir: Path) -> Optional["Plan"]:
        """The plan made for the run in output_dir, once (None: another run's, or none)."""
        plan, plan_dir, self.plan, self.plan_dir = self.plan, self.plan_dir, None, None
        if plan is not None and plan_dir is not None and plan_dir.resolve() == output_dir.resolve():
            return plan
        return None

    def end_the_sweep(self) -> Optional[Path]:
        """The sweep's end undone (its watcher stopped, Ctrl-C given back); its directory, None where none ran."""
        sweep, self.sweep = self.sweep, None
        if sweep is None:
            return None
        sweep.end()
        return sweep.sweep_dir

    def end_the_start(self) -> None:
        over, self.start_is_over = self.start_is_over, None
        if over is not None:
            over()


THIS_PROCESS = ThisProcess()
