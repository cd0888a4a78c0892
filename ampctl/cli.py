"""`ampctl <command> [args]`: the router. It takes the command word, finds the command's record (shell/command.py),
rewrites sys.argv to what follows, and runs the command: a Hydra app keeps every Hydra feature (-m, --cfg, --help,
-cd, run directories); a command of its own parses its arguments itself. Every command leaves through the outcome
table (shell/outcomes.py)."""

from __future__ import annotations

import difflib
import os
import shutil
import sys
import textwrap
from typing import Optional

from ampctl import io
from ampctl.shell.outcomes import leave, refuse, said_in_one_line, stdout_reader_gone

EXAMPLES = """examples:
  ampctl train precision=bf16
  ampctl train precision=fp16 scaler.growth_interval=500 train.steps=200
  ampctl train -m precision=fp16 scaler.growth_interval=100,500,2000
  ampctl train --help          config groups and their options
  ampctl train --cfg job       the composed config, without training
  ampctl init my_exp && ampctl train -cd . -cn my_exp   an experiment of your own"""


def help_text(stream) -> str:
    """`ampctl --help`'s text, its summaries wrapped under themselves where stream is a terminal."""
    from ampctl.shell.command import registry

    width = shutil.get_terminal_size().columns if stream.isatty() else None
    lines = ["usage: ampctl <command> [overrides...]", "",
             "A command-line runner for mixed-precision training experiments in PyTorch.", "", "commands:"]
    for name, command in registry().items():
        line = f"  {name:<8} {command.summary}"
        lines.append(line if width is None else textwrap.fill(line, width, subsequent_indent=" " * 11,
                                                              break_long_words=False))
    return "\n".join(lines) + "\n\n" + io.for_the_terminal(EXAMPLES, stream)


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
        if not stdout_reader_gone():  # another pipe's (a child process's): no reader's choice, not an exit 0
            raise
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
    from ampctl.shell.library_logs import quiet_library_deprecations as quiet

    quiet()


def stdout_is_devnull() -> bool:
    try:
        return os.path.samestat(os.fstat(sys.stdout.fileno()), os.stat(os.devnull))
    except (OSError, ValueError):
        return False


def dispatch(args: list[str]) -> None:
    if not args:  # a command is needed: the usage on stderr, exit 2 (as argparse and git)
        refuse_at_the_door(help_text(sys.stderr).rstrip("\n"))
    if args[0] in ("-h", "--help", "help"):
        print(help_text(sys.stdout))
        return
    if args[0] in ("-V", "--version"):
        from ampctl.version import VERSION

        print(f"ampctl {VERSION}")
        return
    from ampctl.shell import completion
    from ampctl.shell.command import command_named, registry
    from ampctl.shell.hydra_internals import register_schemas

    name, rest = args[0], args[1:]
    completing = name in ("-sc", "--shell-completion")
    if completing:
        name, rest = completion.completion_target(rest)
        if name is None:
            return
    try:
        command = command_named(name)
    except KeyError:
        close = difflib.get_close_matches(name, registry(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        refuse_at_the_door(f"ampctl: unknown command {name!r}; {hint}choose one of: {', '.join(registry())}")
    refuse_an_unknown_assumed_cpu(name)
    register_schemas([name])
    answering = completing and any(a.startswith("query") for a in rest)  # a Tab, not `-sc install=bash`
    if answering and not command.is_hydra_app:
        completion.answer_its_own_completion(command, rest)
        return
    from ampctl.processes import NON_MAIN_HYDRA_OVERRIDES, exit_worker, is_main_process, torchrun_world_size

    under_torchrun = torchrun_world_size() > 1  # train, or export of a sharded checkpoint (its ranks' parts)
    if under_torchrun and command.spans_torchrun_ranks and not is_main_process():
        rest = [*rest, *NON_MAIN_HYDRA_OVERRIDES]  # the other ranks record nothing of their own (run.dir=.)
    # argv[0] is the program's name for Hydra: the shell-completion script it writes registers `ampctl`
    sys.argv = ["ampctl", *rest]
    if command.is_hydra_app:
        from ampctl.shell.hydra_app import run_a_hydra_command

        run_a_hydra_command(command, rest, answering)
    else:
        with said_in_one_line(name):  # its refusal, or a write the machine refused: one line (shell/outcomes.py)
            command.main()
    if under_torchrun:
        exit_worker()


def refuse_at_the_door(line: str) -> None:
    from ampctl.errors import UsageError

    leave(UsageError(line), [line])


def refuse_an_unknown_assumed_cpu(command: str) -> None:
    """AMPCTL_ASSUME_CPU (analysis/cpu_speed.py) naming no kind of CPU: one line before the command runs."""
    from ampctl.analysis.assumed_cpus import check_assumed
    from ampctl.errors import UsageError

    try:
        check_assumed()
    except UsageError as exc:
        refuse(command, str(exc))
