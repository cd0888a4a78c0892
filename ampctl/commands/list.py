"""`ampctl list [device=auto|cpu|cuda]`: every precision mode, scaler, recipe and optimizer, one line each,
and whether each precision mode can run on this machine."""

from __future__ import annotations

import sys
from importlib import resources

import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from ampctl.engine import devices
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.errors import USAGE_EXIT_CODE, UsageError

GROUPS = ("scaler", "recipe", "optimizer")
# The README's table order: baselines first, then autocast modes, then Apex's cast-model levels.
PRECISION_ORDER = ("fp32", "O0", "tf32", "fp16", "O1", "bf16", "O2", "O3", "fp8", "fp8_emulated")


def precision_sort_key(option: str) -> tuple[int, str]:
    return (PRECISION_ORDER.index(option) if option in PRECISION_ORDER else len(PRECISION_ORDER), option)


def yaml_description(group: str, option: str) -> str:
    """The first comment line of conf/<group>/<option>.yaml: every shipped YAML starts with one."""
    text = resources.files("ampctl.conf").joinpath(group, f"{option}.yaml").read_text(encoding="utf-8")
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def parse_device(argv: list[str]) -> str:
    device = "auto"
    for arg in argv:
        key, _, value = arg.partition("=")
        if key != "device" or value not in ("auto", "cpu", "cuda"):
            raise UsageError(f"unexpected argument {arg!r}: ampctl list takes only device=auto|cpu|cuda")
        device = value
    return device


def main() -> None:
    try:
        device = devices.resolve_device(parse_device(sys.argv[1:]))
    except UsageError as exc:
        print(f"ampctl list: error: {exc}", file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)
    console = Console()
    with initialize_config_module(config_module="ampctl.conf", version_base=None):
        loader = GlobalHydra.instance().config_loader()
        table = Table(title=f"precision modes on {device.type} ({devices.device_name(device)})")
        for column in ("precision", "description", "default scaler", "runs here"):
            table.add_column(column)
        for option in sorted(loader.get_group_options("precision"), key=precision_sort_key):
            cfg = compose(config_name="train", overrides=[f"precision={option}"])
            precision = cfg.precision
            try:
                policy = PrecisionPolicy(OmegaConf.to_object(precision), device)
                policy.check()
                slow = policy.slow_here()
                runs = f"[yellow]yes, slowly[/]: {slow}" if slow else "[green]yes[/]"
            except UsageError as exc:
                runs = f"[red]no[/]: {str(exc).split(';')[0].split(': ', 1)[-1]}"
            label = option if option == precision.name else f"{option} (= {precision.name})"
            table.add_row(label, precision.description, cfg.scaler.kind, runs)
        console.print(table)
        for group in GROUPS:
            table = Table(title=f"{group} options")
            table.add_column(group)
            table.add_column("description")
            for option in loader.get_group_options(group):
                table.add_row(option, yaml_description(group, option))
            console.print(table)
    if device.type == "cpu":
        fast = "yes" if devices.has_fast_bf16_cpu() else "no"
        slowdown = devices.cpu_half_slowdown(torch.bfloat16)
        console.print(f"CPU bf16 dot-product instructions (AMX / AVX512-BF16): {fast}; a bf16 autocast matmul takes "
                      f"{slowdown:.2g}x fp32's time here (measured once, cached in ~/.cache/ampctl)")
