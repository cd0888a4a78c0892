"""A command of its own completes from its argparse parser (shell/completion.from_its_parser), as argcomplete reads
one: what is offered is what the parser takes next."""

from __future__ import annotations

from ampctl.errors import OneLineArgumentParser
from ampctl.shell.completion import from_its_parser


def parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="ampctl toy")
    p.add_argument("name")
    kind = p.add_argument("kind", nargs="?")
    kind.completer = lambda current: ["kind=a", "kind=b"]
    p.add_argument("-f", "--from", dest="source", choices=["mlp", "gpt"])
    p.add_argument("--dir")
    p.add_argument("--quick", action="store_true")
    return p


def test_after_an_option_that_takes_a_value_its_values_and_nothing_else():
    assert from_its_parser(parser(), ["x", "--from"], "") == ["mlp", "gpt"]
    assert from_its_parser(parser(), ["x", "--dir"], "") == []  # a directory: the shell's file names


def test_a_positional_without_values_leaves_the_shell_its_file_names():
    assert from_its_parser(parser(), [], "") == []
    assert from_its_parser(parser(), [], "ru") == []


def test_the_next_positional_is_counted_past_options_and_their_values():
    assert from_its_parser(parser(), ["--from", "mlp", "x"], "k")[:2] == ["kind=a", "kind=b"]
    assert from_its_parser(parser(), ["x", "--quick"], "")[:2] == ["kind=a", "kind=b"]
    options = ["-h", "--help", "-f", "--from", "--dir", "--quick"]
    assert from_its_parser(parser(), ["x"], "") == ["kind=a", "kind=b", *options]  # nothing typed: both
    assert from_its_parser(parser(), ["x", "kind=a"], "") == options  # every positional given


def test_a_dash_asks_for_the_options():
    assert from_its_parser(parser(), ["x"], "--") == ["-h", "--help", "-f", "--from", "--dir", "--quick"]
