"""Shell completion through the router: Hydra's completion script calls `ampctl -sc query=bash` with COMP_LINE set;
the query goes to the command COMP_LINE names (a Hydra app answers with Hydra's completion, a command of its own with
its record's complete), and before a command word is complete the command words are the answer."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path
from typing import Iterator, Optional

from ampctl.shell.command import Command, registry


def completion_words() -> tuple[list[str], str]:
    """The words of COMP_LINE after the command (routed by completion_target), and the one being typed."""
    line = os.environ.get("COMP_LINE", "")
    words = line.split()[1:]
    if line.endswith(" ") or not words:
        return words, ""
    return words[:-1], words[-1]


@contextlib.contextmanager
def list_keys_completed_whole(command: Command) -> Iterator[None]:
    """Around Hydra's completion of a Hydra app: its answer, with the list-typed keys ending in `=`
    (conf/completion.py)."""
    from ampctl.conf.completion import set_lists_whole

    answer = io.StringIO()
    with contextlib.redirect_stdout(answer):
        yield
    separator = "\n" if "\n" in answer.getvalue().strip() else " "
    words = answer.getvalue().split()
    print(separator.join(the_values_it_may_take(command) or set_lists_whole(words, command.schema)))


def the_values_it_may_take(command: Command) -> Optional[list[str]]:
    """`key=` being typed, where the schema says what the key's value may be (conf/completion.value_choices): those
    that start as typed. None: Hydra's answer stands."""
    from ampctl.conf.completion import value_choices
    from ampctl.shell.hydra_internals import config_loader, hydra_flags

    done, current = completion_words()
    key, typed_equals, typed = current.partition("=")
    if not typed_equals or command.schema is None:
        return None
    config_dir = hydra_flags(done)[0].get("config_dir")
    loader = config_loader(Path(config_dir) if config_dir else None)
    choices = value_choices(command.schema, key.lstrip("+~"), loader.get_group_options)
    return None if choices is None else [f"{key}={choice}" for choice in choices if choice.startswith(typed)]


def answer_its_own_completion(command: Command, rest: list[str]) -> None:
    """A command of its own (not a Hydra app) answers its completion itself, from its parser: its main would take
    the query for its arguments and refuse it."""
    done, current = completion_words()
    words = from_its_parser(command.arguments(), done, current) if command.arguments else []
    print(("\n" if "query=fish" in rest else " ").join(words))


def from_its_parser(parser: argparse.ArgumentParser, done: list[str], current: str) -> list[str]:
    """The words that may come next, read from an argparse parser as argcomplete reads one: after an option that
    takes a value, that value's; else the next positional argument's values (its choices, or its completer's: none,
    a path or a name of the user's, leaves the shell's file names), and the options where a `-` is typed or nothing
    is left to give."""
    actions = parser._actions  # argparse's list of what it parses: argcomplete and shtab read the same
    by_option = {option: action for action in actions for option in action.option_strings}
    if done and done[-1] in by_option and by_option[done[-1]].nargs != 0:
        return _values(by_option[done[-1]], current)
    options = [option for action in actions for option in action.option_strings]
    if current.startswith("-"):
        return options
    positionals = [action for action in actions if not action.option_strings]
    given, after_option = 0, False
    for word in done:
        if after_option:
            after_option = False
        elif word in by_option:
            after_option = by_option[word].nargs != 0
        else:
            given += 1
    if given >= len(positionals) and not (positionals and positionals[-1].nargs in ("*", "+")):
        return options
    values = _values(positionals[min(given, len(positionals) - 1)], current)
    return [*values, *options] if values and not current else values


def _values(action: argparse.Action, current: str) -> list[str]:
    completer = getattr(action, "completer", None)
    if completer is not None:
        return list(completer(current))
    return [str(choice) for choice in action.choices or ()]


def completion_target(rest: list[str]) -> tuple[Optional[str], list[str]]:
    """`ampctl -sc query=bash`, called by the completion script Hydra installs: route the query to the
    command in COMP_LINE, with that word taken out so that Hydra sees `ampctl <overrides>`. Before a command
    word is complete, the command words are the answer. `ampctl -sc install=bash` installs through train."""
    line = os.environ.get("COMP_LINE")
    if not any(arg.startswith("query") for arg in rest) or line is None:
        return "train", ["-sc", *rest]
    words = line.split()
    if len(words) >= 2 and words[1] in registry() and (len(words) > 2 or line.endswith(" ")):
        os.environ["COMP_LINE"] = " ".join([words[0], *words[2:]]) + (" " if line.endswith(" ") else "")
        return words[1], ["-sc", *rest]
    print(("\n" if "query=fish" in rest else " ").join(registry()))
    return None, []
