"""`ampctl <command> [args]`: a router only. It takes the command word, rewrites sys.argv to what follows,
and calls that command's own entry point, so each command keeps every Hydra feature (-m, --cfg, --help,
-cd, run directories)."""

from __future__ import annotations

import contextlib
import difflib
import errno
import importlib
import io
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Iterator, Optional

from ampctl.errors import CommandLineRefused, SomeRunsFailed, UsageError, cannot_write, write_refused
from ampctl.shell.outcomes import leave, refuse, said_in_one_line, write_refused_line

# command -> (module, function, one-line description)
COMMANDS = {
    "train": ("ampctl.commands.train", "train", "train a recipe under a precision mode (a Hydra app: try --help)"),
    "compare": ("ampctl.commands.compare", "compare",
                "the same run under several precision modes, one table and report"),
    "memory": ("ampctl.commands.memory", "memory",
               "estimated memory per part next to the measured peak, per precision mode"),
    "inspect": ("ampctl.commands.inspect_ranges", "inspect",
                "where values fall against fp16, bf16 and FP8 ranges, per layer"),
    "advise": ("ampctl.commands.advise", "advise",
               "the precision mode for this model on this machine, with the evidence"),
    "export": ("ampctl.commands.export", "main",
               "a checkpoint's weights in the dtype you serve: safetensors, pt or a transformers directory"),
    "report": ("ampctl.commands.report", "main",
               "the table, files and plots of a run, multirun or compare directory, again"),
    "list": ("ampctl.commands.list", "main",
             "list precision modes, scalers, recipes and optimizers, and what runs here"),
    "init": ("ampctl.commands.init", "main", "write an editable experiment config and recipe of your own"),
}


def print_help() -> None:
    print("usage: ampctl <command> [overrides...]\n")
    print("A command-line runner for mixed-precision training experiments in PyTorch.\n")
    print("commands:")
    for name, (_, _, description) in COMMANDS.items():
        print(f"  {name:<8} {description}")
    print("\nexamples:")
    print("  ampctl train precision=bf16")
    print("  ampctl train precision=fp16 scaler.growth_interval=500 train.steps=200")
    print("  ampctl train -m precision=fp16 scaler.growth_interval=100,500,2000")
    print("  ampctl train --help          config groups and their options")
    print("  ampctl train --cfg job       the composed config, without training")
    print("  ampctl init my_exp && ampctl train -cd . -cn my_exp   an experiment of your own")


def main(argv: Optional[list[str]] = None) -> None:
    from ampctl.interrupt import interrupts_surfaced, raise_on_signals, signal_name
    from ampctl.processes import die_with_parent

    die_with_parent()  # a comparison's mode, when the comparison is gone
    devnull_from_the_start = stdout_is_devnull()
    try:
        # inside the try: a signal that lands the moment its handler is set is said in one line too (one that
        # landed between this and the try came out as a traceback)
        raise_on_signals()  # SIGTERM, SIGHUP, SIGUSR1/2 outside a training loop: one line, as Ctrl-C
        quiet_library_deprecations()
        with interrupts_surfaced():
            dispatch(sys.argv[1:] if argv is None else list(argv))
        sys.stdout.flush()  # inside the try: a reader that stopped early is seen here, not at exit
    except BrokenPipeError as exc:
        # `ampctl list | head -1`: the reader has what it wanted; not an error. Python's own flush at exit
        # would fail again on the closed pipe, so stdout goes to /dev/null (the recipe in Python's docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        leave(exc, [])
    except KeyboardInterrupt as exc:
        # Ctrl-C (or another stop signal) before a command could stop gracefully (importing torch, composing,
        # Hydra making the run directory: run_hydra_app removes that): nothing was recorded
        leave(exc, [f"\nampctl: interrupted ({signal_name(exc)}) before anything was recorded"])
    except SystemExit as exc:
        # rich handles a closed pipe itself: stdout to /dev/null, then SystemExit(1). The same case as above
        # (told apart from a failed run whose output the user sent to /dev/null).
        if exc.code == 1 and not devnull_from_the_start and stdout_is_devnull():
            leave(BrokenPipeError(), [])
        raise


def quiet_library_deprecations() -> None:
    """torchao (imported by precision=fp8 and by transformers) registers enums with torch's pytree, which newer
    torch logs as deprecated at every import: two lines about libraries' internals before every such run."""
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda record: "is an Enum subclass and is now natively supported" not in record.getMessage())
    # alembic (under Optuna's storages and MLflow) logs "setup plugin ..." at INFO, and Hydra's console handler on
    # the root logger printed a dozen of them before a sweep's first job
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # botocore (s3fs's aiobotocore, under train.checkpoint_mirror=s3://...) logs "Found credentials in environment
    # variables." at INFO: printed through that handler before the run's own first line, in every run with an S3 mirror
    for name in ("botocore.credentials", "aiobotocore.credentials"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # inductor (torchao's optimizers compile their update) asks for CUDA_HOME on a CPU-only machine with a CUDA
    # build of torch, and torch logs that it found no CUDA runtime there: a line about torch's install mid-run
    logging.getLogger("torch.utils.cpp_extension").addFilter(
        lambda record: "No CUDA runtime is found" not in record.getMessage())
    # and AOTAutograd warns, on that compile, that torchao's optimizer-state tensor subclasses lack a hash for its
    # cache: advice to torchao's authors, two lines in the middle of the user's run
    warnings.filterwarnings("ignore", message=r".* does not implement _stable_hash_for_caching", category=UserWarning)


def stdout_is_devnull() -> bool:
    try:
        return os.path.samestat(os.fstat(sys.stdout.fileno()), os.stat(os.devnull))
    except (OSError, ValueError):
        return False


def dispatch(args: list[str]) -> None:
    if not args or args[0] in ("-h", "--help", "help"):
        print_help()
        return
    if args[0] in ("-V", "--version"):
        from ampctl.version import VERSION

        print(f"ampctl {VERSION}")
        return
    command, rest = args[0], args[1:]
    completing = command in ("-sc", "--shell-completion")
    if completing:
        command, rest = completion_target(rest)
        if command is None:
            return
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        line = f"ampctl: unknown command {command!r}; {hint}choose one of: {', '.join(COMMANDS)}"
        leave(UsageError(line), [line])

    refuse_an_unknown_assumed_cpu(command)
    from ampctl.conf.schema import register_configs

    register_configs(command)
    module_name, function_name, _ = COMMANDS[command]
    module = importlib.import_module(module_name)
    entry = getattr(module, function_name)
    answering = completing and any(a.startswith("query") for a in rest)  # a Tab, not `-sc install=bash`
    if answering and not hasattr(entry, "__wrapped__"):
        # a command of its own (not a Hydra app) answers its completion itself: its main would take the query
        # for its arguments and refuse it
        done, current = completion_words()
        print(("\n" if "query=fish" in rest else " ").join(module.complete(done, current)))
        return
    under_torchrun = False
    if command == "train":
        from ampctl.processes import NON_MAIN_HYDRA_OVERRIDES, is_main_process, torchrun_world_size

        under_torchrun = torchrun_world_size() > 1
        if not is_main_process():
            rest = [*rest, *NON_MAIN_HYDRA_OVERRIDES]
    # argv[0] is the program's name for Hydra: the shell-completion script it writes registers `ampctl`
    sys.argv = ["ampctl", *rest]
    if hasattr(entry, "__wrapped__"):  # a @hydra.main app (its primary config is named as the command)
        run_a_hydra_command(command, entry, rest, answering)
    else:
        with said_in_one_line(command):  # its refusal, or a write the machine refused: one line (shell/outcomes.py)
            entry()
    if under_torchrun:
        from ampctl.processes import exit_worker

        exit_worker()


def run_a_hydra_command(command: str, entry, rest: list[str], answering: bool) -> None:
    """A Hydra app's command line checked (its flags, its config, the sweep a resume continues), then the app run;
    answering: Hydra's completion of it."""
    from ampctl.shell.hydra_internals import put_config_dir_on_path, refuse_a_config_that_is_not_ampctls

    put_config_dir_on_path(rest)
    try:
        refuse_bad_hydra_flags(rest)
        refuse_a_config_that_is_not_ampctls(command, command, rest)
        if command == "train":
            from ampctl.shell.sweep_resume import with_the_sweep_to_continue

            sys.argv = ["ampctl", *with_the_sweep_to_continue(rest)]
    except UsageError as exc:
        refuse(command, str(exc))
    if answering:
        answer_hydras_completion(command, entry)
        return
    from ampctl.processes import start_kept_out_of_collections

    with start_kept_out_of_collections():  # until the run is planned (shell/checks.py)
        run_hydra_app(command, entry)


def refuse_an_unknown_assumed_cpu(command: str) -> None:
    """AMPCTL_ASSUME_CPU (analysis/cpu_speed.py) naming no kind of CPU: one line before the command runs."""
    from ampctl.analysis.assumed_cpus import check_assumed

    try:
        check_assumed()
    except UsageError as exc:
        refuse(command, str(exc))


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


def run_hydra_app(command: str, entry) -> None:
    """Run a command's @hydra.main. What fails before its task function runs — composing the config, the
    check of every job of a sweep — is the user's command line: one line, exit 2. Hydra prints such errors
    itself (several lines, exit 1) unless HYDRA_FULL_ERROR=1 lets them reach us."""
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ampctl.conf.messages import key_under_null_node, one_line, unparsable_override, yaml_error

    os.environ["HYDRA_FULL_ERROR"] = "1"
    from ampctl.interrupt import interrupts_surfaced
    from ampctl.shell import checks
    from ampctl.shell.hydra_internals import mode_read_from_the_command_line
    from ampctl.shell.unfinished_sweep import report_the_unfinished_sweep

    try:
        # a stop signal that broke off composing is the signal, not a refusal of the command line
        with job_config_with_its_defaults(command), mode_read_from_the_command_line(sys.argv[1:]), \
                interrupts_surfaced():
            entry()  # raises SystemExit when the run fails
    except KeyboardInterrupt as exc:
        report_the_unfinished_sweep(command, exc)  # a sweep's launcher waiting for its jobs: the table, one line
        # between Hydra making the run directory and the task function taking over: it holds only Hydra's files
        if checks.planned is not None:
            from ampctl.processes import is_main_process
            from ampctl.runner.ownership import remove_if_only_hydra_files

            if is_main_process():
                remove_if_only_hydra_files(checks.planned.run_dir)
        raise
    except CommandLineRefused as exc:
        refuse(command, str(exc))
    except SomeRunsFailed as exc:  # a sweep whose table names failed jobs (reports/sweep.py)
        leave(exc, [])
    except (UsageError, HydraException, OmegaConfBaseException, AssertionError, ValueError) as exc:
        if raised_in(exc, entry.__wrapped__):
            raise  # an error inside a job is not the command line's: the job reported it, or it is a bug
        refused = write_refused_in(exc)
        if refused is not None:  # Hydra could not open the run's log in it (logging's "Unable to configure handler")
            leave(refused, [write_refused_line(command, refused, "; the run directory refuses writes (read-only, "
                                                                 "full): nothing was changed in it")])
        refuse(command, str(exc) if isinstance(exc, UsageError) else (
            key_under_null_node(sys.argv[1:]) or unparsable_override(sys.argv[1:], exc) or one_line(exc)))
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
        head = defaults_of_a_job(command, dict(cfg.hydra.runtime.choices))
        # its values too, as a run would check them (train.steps=-1), before the dump is shown as loadable
        from ampctl.conf.composing import without_hydra_node
        from ampctl.conf.schema import validate
        from ampctl.shell.checks import typed

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


def completion_words() -> tuple[list[str], str]:
    """The words of COMP_LINE after the command (routed by completion_target), and the one being typed."""
    line = os.environ.get("COMP_LINE", "")
    words = line.split()[1:]
    if line.endswith(" ") or not words:
        return words, ""
    return words[:-1], words[-1]


def answer_hydras_completion(command: str, entry) -> None:
    """Hydra's completion of a Hydra app, its list-typed keys ending in `=` (conf/completion.py)."""
    from ampctl.conf.completion import set_lists_whole
    from ampctl.conf.schema import APP_SCHEMAS

    answer = io.StringIO()
    with contextlib.redirect_stdout(answer):
        run_hydra_app(command, entry)
    separator = "\n" if "\n" in answer.getvalue().strip() else " "
    words = answer.getvalue().split()
    print(separator.join(set_lists_whole(words, APP_SCHEMAS[command][1])))


def completion_target(rest: list[str]) -> tuple[Optional[str], list[str]]:
    """`ampctl -sc query=bash`, called by the completion script Hydra installs: route the query to the
    command in COMP_LINE, with that word taken out so that Hydra sees `ampctl <overrides>`. Before a command
    word is complete, the command words are the answer. `ampctl -sc install=bash` installs through train."""
    line = os.environ.get("COMP_LINE")
    if not any(arg.startswith("query") for arg in rest) or line is None:
        return "train", ["-sc", *rest]
    words = line.split()
    if len(words) >= 2 and words[1] in COMMANDS and (len(words) > 2 or line.endswith(" ")):
        os.environ["COMP_LINE"] = " ".join([words[0], *words[2:]]) + (" " if line.endswith(" ") else "")
        return words[1], ["-sc", *rest]
    print(("\n" if "query=fish" in rest else " ").join(COMMANDS))
    return None, []
