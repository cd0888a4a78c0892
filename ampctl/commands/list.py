"""`ampctl list [-cd DIR] [device=auto|cpu|cuda]`: every precision mode, scaler, recipe, optimizer and logger
(the user's own in DIR too), one line each, and whether each precision mode can run on this machine."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.config_loader import ConfigLoader
from hydra.types import RunMode
from omegaconf import OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ampctl.errors import OneLineArgumentParser, UsageError
from ampctl.shell.command import Command, Section
from ampctl.shell.hydra_internals import config_loader

if TYPE_CHECKING:
    import torch

GROUPS = ("scaler", "recipe", "optimizer", "logger")
# how the YAML of a shipped option built to fail one known way opens (recipes/demonstrations.py)
DEMONSTRATION = "Demonstration:"
DTYPE_ORDER = ("float32", "float16", "bfloat16")


def precision_sort_key(option: str, precision: Any) -> tuple:
    """docs/precision.md's table order, from what each mode does: the fp32 baselines, the autocast modes, Apex's
    cast-model levels, then the converter modes; fp16 before bf16, and Apex's names after the ones they alias."""
    kind = 3 if precision.converter else 2 if precision.cast_model else 1 if precision.autocast else 0
    if kind == 3:
        return (kind, option)
    return (kind, precision.tf32, DTYPE_ORDER.index(precision.dtype.name), option[:1] == "O", option)


def yaml_description(group: str, option: str) -> str:
    """The first sentence of ampctl/conf/<group>/<option>.yaml's opening comment: every shipped YAML starts with one."""
    return first_sentence(resources.files("ampctl.conf").joinpath(group, f"{option}.yaml").read_text(encoding="utf-8"))


def first_sentence(yaml_text: str) -> str:
    """The first sentence of a YAML file's opening comment block (rich markup in it shown as written)."""
    lines = []
    for line in yaml_text.splitlines():
        if not line.startswith("#"):
            if lines:
                break
            continue
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    end = text.find(". ")
    return escape(text if end < 0 else text[:end + 1])


DEVICES = ("device=auto", "device=cpu", "device=cuda")


def arguments() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="ampctl list", description="Every precision mode, scaler, recipe, optimizer and logger, one line "
        "each, and whether each precision mode runs (fast) on this machine.",
        epilog="example: ampctl list -cd my_conf device=cpu")
    device = parser.add_argument("device", nargs="?", default="device=auto", metavar="device=auto|cpu|cuda",
                                 help="the device to check the precision modes against (default: auto)")
    device.completer = lambda current: list(DEVICES)
    parser.add_argument("--remeasure", action="store_true",
                        help="measure this CPU's fp32 and half-precision matmul speed again (kept in ~/.cache/ampctl; "
                             "every command uses these figures)")
    parser.add_argument("-cd", "--config-dir", type=Path, metavar="DIR",
                        help="also list the options and experiment configs in DIR, as `ampctl train -cd DIR` sees them")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = arguments()
    args = parser.parse_args(argv)
    key, _, value = args.device.partition("=")
    if key != "device" or value not in ("auto", "cpu", "cuda"):
        parser.error(f"unexpected argument {args.device!r}: ampctl list takes device=auto|cpu|cuda")
    args.device = value
    if args.config_dir is not None and not args.config_dir.is_dir():
        parser.error(f"-cd {str(args.config_dir)!r} is not a directory")
    return args


def option_description(loader, group: str, option: str) -> str:
    """The first comment line of the option's YAML (every shipped one starts with one), wherever it lives."""
    found = loader.repository.load_config(f"{group}/{option}")
    if found is None or not found.path.startswith("file://"):
        return yaml_description(group, option)
    return first_comment(Path(found.path[len("file://"):]) / group / f"{option}.yaml")


def first_comment(path: Path) -> str:
    return first_sentence(path.read_text(encoding="utf-8"))


def main() -> None:
    args = parse_args(sys.argv[1:])  # argparse: --help, and a bad argument is one line, exit 2
    # torch, from here: --help answers without it
    from ampctl.engine import devices

    device = devices.resolve_device(args.device)
    console = Console()
    if device.type == "cpu":
        _measure_the_cpu_if_needed(console, args.remeasure)
    loader = config_loader(args.config_dir)
    console.print(_modes_table(loader, device))
    for group in GROUPS:
        described = {option: option_description(loader, group, option) for option in loader.get_group_options(group)}
        shown = {option: text for option, text in described.items() if not text.startswith(DEMONSTRATION)}
        demonstrations = {option: text[len(DEMONSTRATION):].strip() for option, text in described.items()
                          if option not in shown}
        demonstrations = {option: text[:1].upper() + text[1:] for option, text in demonstrations.items()}
        console.print(_options_table(f"{group} options", group, shown))
        if demonstrations:
            console.print(_options_table(f"demonstration {group}s: built to fail one known way", group,
                                         demonstrations))
    if args.config_dir is not None:
        _print_experiment_configs(console, args.config_dir)
    if device.type == "cpu":
        _print_the_cpus_figures(console)


def _options_table(title: str, group: str, descriptions: dict[str, str]) -> Table:
    table = Table(title=title)
    table.add_column(group)
    table.add_column("description")
    for option, text in descriptions.items():
        table.add_row(option, text)
    return table


def _measure_the_cpu_if_needed(console: Console, remeasure: bool) -> None:
    """The CPU's figures, measured here where none are kept (or --remeasure): a wait of seconds, said."""
    from ampctl.analysis import cpu_speed
    from ampctl.reports import tables

    if remeasure or cpu_speed.measuring_needed():
        tables.print_line(console, "measuring this CPU's matmuls (fp32, and the half types its flags do not decide, "
                          f"in alternating rounds, ~5-30 s; kept in {cpu_speed.cache_path()} for every command)")
        with console.status("measuring this CPU's matmuls"):
            cpu_speed.measured(remeasure=remeasure)


def _modes_table(loader: ConfigLoader, device: torch.device) -> Table:
    """Every precision mode of the config search path: what it is, its default scaler, whether it runs here."""
    from ampctl.analysis import mode_advice
    from ampctl.engine import devices
    from ampctl.engine.precision.policy import PrecisionPolicy

    table = Table(title=f"precision modes on {device.type} ({devices.device_name(device)})")
    for column in ("precision", "description", "default scaler", "runs here"):
        table.add_column(column)
    composed = {option: loader.load_configuration(config_name="train", overrides=[f"precision={option}"],
                                                  run_mode=RunMode.RUN)
                for option in loader.get_group_options("precision")}
    for option, cfg in sorted(composed.items(), key=lambda item: precision_sort_key(item[0], item[1].precision)):
        precision = cfg.precision
        try:
            policy = PrecisionPolicy(OmegaConf.to_object(precision), device)
            policy.check()
            slow = mode_advice.slow_here(policy)
            runs = f"[yellow]yes, slowly[/]: {slow}" if slow else "[green]yes[/]"
        except UsageError as exc:
            runs = f"[red]no[/]: {str(exc).split(';')[0].split(': ', 1)[-1]}"
        label = option if option == precision.name else f"{option} (= {precision.name})"
        table.add_row(label, precision.description, cfg.scaler.kind, runs)
    return table


def _print_experiment_configs(console: Console, config_dir: Path) -> None:
    from ampctl.reports import tables

    experiments = sorted(config_dir.glob("*.yaml"))
    table = Table(title=f"experiment configs in {config_dir}")
    table.add_column("NAME")
    table.add_column("description")
    for path in experiments:
        table.add_row(path.stem, first_comment(path))
    console.print(table if experiments else f"no experiment configs (*.yaml) at the top of {config_dir}")
    if experiments:
        tables.print_line(console, f"run one with: ampctl train -cd {config_dir} -cn NAME")


def _print_the_cpus_figures(console: Console) -> None:
    from ampctl.analysis import cpu_speed
    from ampctl.engine import devices
    from ampctl.reports import tables

    speed = cpu_speed.measured()
    mixed = f", with the half types of an assumed {speed.assumed} CPU" if speed.assumed else ""
    tables.print_line(console, f"This CPU ({devices.cpu_model()}{mixed}), as measured (the figures behind the "
                      f"table above, the start warnings, compare's default modes and MFU; "
                      f"{cpu_speed.cache_path()}; again with --remeasure):")
    for line in speed.describe():
        tables.print_line(console, f"  {escape(line)}")


COMMAND = Command(name="list", summary="list precision modes, scalers, recipes and optimizers, and what runs here",
                  section=Section.SETUP, main=main, arguments=arguments)
