"""A Hydra app run as a command: its command line checked (Hydra's flags, its config), the app run, and what fails
before its task function runs said as the command line's one line, exit 2 (Hydra prints such errors itself in
several lines, exit 1, unless HYDRA_FULL_ERROR=1 lets them reach ampctl)."""

from __future__ import annotations

import contextlib
import difflib
import errno
import io
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NoReturn, Optional

from ampctl.errors import CommandLineRefused, NothingToDo, SomeRunsFailed, UsageError, cannot_write, write_refused
from ampctl.shell.outcomes import leave, refuse, write_refused_line
from ampctl.shell.this_process import THIS_PROCESS

if TYPE_CHECKING:
    from ampctl.shell.command import Command

# Hydra's flags whose value is one of a few: argparse would answer a wrong one with its whole usage block
HYDRA_FLAG_CHOICES = {"cfg": ("job", "hydra", "all"),
                      "info": ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")}


def refuse_bad_hydra_flags(args: list[str]) -> None:
    """`--cfg jobz`: one line naming the flag, its value and the choices."""
    from ampctl.shell.hydra_internals import hydra_flags

    flags, overrides = hydra_flags(args)
    unknown = next((arg for arg in overrides if arg.startswith("-")), None)
    if unknown is not None:  # argparse would print its usage block (8 lines) above its one line
        raise UsageError(f"{unknown}: no such flag; overrides are key=value, and --help lists the flags")
    for name, choices in HYDRA_FLAG_CHOICES.items():
        value = flags.get(name)
        if value and value not in choices:
            close = difflib.get_close_matches(value, choices, n=1)
            raise UsageError(f"--{name} {value}: no such choice{f' (did you mean {close[0]}?)' if close else ''}; "
                             f"choose one of {', '.join(choices)}")


def run_a_hydra_command(command: Command, rest: list[str], answering: bool) -> None:
    """A Hydra app's command line checked (its flags, its config, the sweep a resume continues), then the app run;
    answering: Hydra's completion of it."""
    from ampctl.shell.hydra_internals import put_config_dir_on_path, refuse_a_config_that_is_not_ampctls

    put_config_dir_on_path(rest)
    try:
        refuse_bad_hydra_flags(rest)
        refuse_a_config_that_is_not_ampctls(command.name, command.name, rest)
        if command.continues_sweeps:  # a sweep resumed: its own command line (conf/sweeps.py)
            from ampctl.shell.sweep_resume import with_the_sweep_to_continue

            sys.argv = ["ampctl", *with_the_sweep_to_continue(rest)]
    except UsageError as exc:
        refuse(command.name, str(exc))
    if answering:
        from ampctl.shell.completion import list_keys_completed_whole

        with list_keys_completed_whole(command):
            run_hydra_app(command.name, command.main)
        return
    from ampctl.processes import start_kept_out_of_collections

    with start_kept_out_of_collections() as start_is_over:  # until the run is planned (shell/checks.py)
        THIS_PROCESS.start_is_over = start_is_over
        run_hydra_app(command.name, command.main)


def run_hydra_app(command: str, entry) -> None:
    """Run a command's @hydra.main. What fails before its task function runs — composing the config, the
    check of every job of a sweep — is the user's command line: one line, exit 2. Hydra prints such errors
    itself (several lines, exit 1) unless HYDRA_FULL_ERROR=1 lets them reach us."""
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ampctl.conf.messages import yaml_error

    os.environ["HYDRA_FULL_ERROR"] = "1"
    from ampctl.interrupt import interrupts_surfaced
    from ampctl.shell.unfinished_sweep import report_the_unfinished_sweep

    try:
        # a stop signal that broke off composing is the signal, not a refusal of the command line
        with job_config_with_its_defaults(command), interrupts_surfaced():
            entry()  # raises SystemExit when the run fails
    except KeyboardInterrupt as exc:
        _stopped_before_the_task(command, exc)
        raise
    except CommandLineRefused as exc:
        refuse(command, str(exc))
    except NothingToDo as exc:  # found before Hydra wrote anything: said, exit 0
        print(f"ampctl {command}: {exc}")
    except SomeRunsFailed as exc:  # a sweep whose table names failed jobs (reports/sweep.py)
        leave(exc, [])
    except (UsageError, HydraException, OmegaConfBaseException, AssertionError, ValueError) as exc:
        if raised_in(exc, entry.__wrapped__):
            raise  # an error inside a job is not the command line's: the job reported it, or it is a bug
        _refuse_what_composing_refused(command, exc)
    except yaml.YAMLError as exc:  # a config file under -cd that is not YAML
        if raised_in(exc, entry.__wrapped__):
            raise
        refuse(command, yaml_error(exc))
    except RecursionError:  # Hydra composing a config that includes itself
        refuse(command, config_includes_itself(command))
    except OSError as exc:  # after Hydra's: its MissingConfigException is an OSError
        cannot_create = exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EEXIST) and exc.filename is not None
        if not (write_refused(exc) or cannot_create) or raised_in(exc, entry.__wrapped__):
            raise
        # Hydra could not create the run directory or write its .hydra/ files: the directory the user chose
        refuse(command, f"{cannot_write(exc)}; choose a writable hydra.run.dir (or hydra.sweep.dir)")
    except Exception as exc:  # a launcher that runs the jobs elsewhere failed while its sweep ran
        if not raised_in(exc, entry.__wrapped__):
            report_the_unfinished_sweep(command, exc)
        raise


def _stopped_before_the_task(command: str, stop: KeyboardInterrupt) -> None:
    """A stop while Hydra composed or launched: a sweep's launcher waiting for its jobs says its table in one
    line; a run directory Hydra made before the task function took over holds only Hydra's files, removed."""
    from ampctl.processes import is_main_process
    from ampctl.runner.ownership import remove_if_only_hydra_files
    from ampctl.shell.unfinished_sweep import report_the_unfinished_sweep

    report_the_unfinished_sweep(command, stop)
    planned_dir = THIS_PROCESS.plan_dir
    if planned_dir is not None and is_main_process():
        remove_if_only_hydra_files(planned_dir)


def _refuse_what_composing_refused(command: str, exc: Exception) -> NoReturn:
    """The command line's mistake as one line, exit 2; a run directory that refused Hydra's log, exit 74."""
    from ampctl.conf.messages import key_under_null_node, one_line, unparsable_override

    refused = write_refused_in(exc)
    if refused is not None:  # Hydra could not open the run's log in it (logging's "Unable to configure handler")
        leave(refused, [write_refused_line(command, refused, "; the run directory refuses writes (read-only, "
                                                             "full): nothing was changed in it")])
    refuse(command, str(exc) if isinstance(exc, UsageError) else (
        key_under_null_node(sys.argv[1:]) or unparsable_override(sys.argv[1:], exc) or one_line(exc)))


def config_includes_itself(command: str) -> str:
    from ampctl.shell.hydra_internals import hydra_flags

    name = hydra_flags(sys.argv[1:])[0].get("config_name") or command
    return (f"the config {name} includes itself in its defaults list (directly, or through a config it names): "
            "remove the cycle")


@contextlib.contextmanager
def job_config_with_its_defaults(command: str) -> Iterator[None]:
    """`--cfg job`: Hydra prints the job's config; ampctl puts the defaults list it was composed from before it, so
    that the dump loads again as an ampctl config (`-cd DIR -cn NAME`: ampctl's checks, run directory, logging)."""
    from ampctl.conf.composing import defaults_of_a_job
    from ampctl.shell.hydra_internals import composed, hydra_flags

    flags, overrides = hydra_flags(sys.argv[1:])
    if flags.get("cfg") != "job" or "package" in flags or "multirun" in flags:
        yield
        return
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        yield
    config_dir = flags.get("config_dir")
    with composed(flags.get("config_name") or command, overrides, Path(config_dir) if config_dir else None) as cfg:
        head = defaults_of_a_job(command, cfg)
        # its values too, as a run would check them (train.steps=-1), before the dump is shown as loadable
        from ampctl.conf.composing import without_hydra_node
        from ampctl.conf.schema import validate
        from ampctl.shell.plans import typed

        validate(typed(command, without_hydra_node(cfg)))
    sys.stdout.write(head + printed.getvalue())


def write_refused_in(exc: BaseException) -> Optional[OSError]:
    """The write the machine refused that exc was raised from or during, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if write_refused(exc):
            return exc  # type: ignore[return-value]
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def raised_in(exc: BaseException, function) -> bool:
    """Whether `function` is on exc's traceback."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is function.__code__:
            return True
        tb = tb.tb_next
    return False
