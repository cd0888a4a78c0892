"""`ampctl <command> [args]`: a router only. It takes the command word, rewrites sys.argv to what follows,
and calls that command's own entry point, so each command keeps every Hydra feature (-m, --cfg, --help,
-cd, run directories)."""

from __future__ import annotations

import importlib
import sys
from typing import Optional

from ampctl.errors import USAGE_EXIT_CODE, UsageError

# command -> (module, function, one-line description)
COMMANDS = {
    "train": ("ampctl.commands.train", "train", "train a recipe under a precision mode (a Hydra app: try --help)"),
    "compare": ("ampctl.commands.compare", "compare", "the same run under several precision modes, one table and report"),
    "memory": ("ampctl.commands.memory", "memory", "estimated memory per part next to the measured peak, per precision mode"),
    "inspect": ("ampctl.commands.inspect_ranges", "inspect", "where values fall against fp16, bf16 and FP8 ranges, per layer"),
    "report": ("ampctl.commands.report", "main", "the table, files and plots of a run, multirun or compare directory, again"),
    "list": ("ampctl.commands.list", "main", "list precision modes, scalers, recipes and optimizers, and what runs here"),
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


def refuse_distributed(cfg, command: str) -> None:
    if cfg.distributed.kind.value != "none":
        raise UsageError(f"distributed={cfg.distributed.kind.value}: ampctl {command} runs on one device; "
                         f"data parallelism is for ampctl train under torchrun")


def validate_compare(cfg) -> None:
    from ampctl.conf.schema import validate

    validate(cfg)
    refuse_distributed(cfg, "compare")
    if cfg.compare.warmup_steps < 0:
        raise UsageError(f"compare.warmup_steps={cfg.compare.warmup_steps} is not allowed: expected an integer >= 0")


def validate_memory(cfg) -> None:
    from ampctl.analysis.memory.model import parse_size
    from ampctl.conf.schema import validate

    validate(cfg)
    refuse_distributed(cfg, "memory")
    m = cfg.memory
    if m.steps < 1:
        raise UsageError(f"memory.steps={m.steps} is not allowed: expected an integer >= 1")
    if m.timed_steps < 0:
        raise UsageError(f"memory.timed_steps={m.timed_steps} is not allowed: expected an integer >= 0")
    if m.budget is not None:
        parse_size(m.budget)


def validate_inspect(cfg) -> None:
    from ampctl.analysis.ranges import power_of_two_log2
    from ampctl.conf.schema import validate

    validate(cfg)
    refuse_distributed(cfg, "inspect")
    if cfg.inspect.steps < 1:
        raise UsageError(f"inspect.steps={cfg.inspect.steps} is not allowed: expected an integer >= 1")
    if cfg.inspect.loss_scale is not None:
        power_of_two_log2(cfg.inspect.loss_scale, "inspect.loss_scale")


def main(argv: Optional[list[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print_help()
        return
    if args[0] in ("-V", "--version"):
        from ampctl import __version__

        print(f"ampctl {__version__}")
        return
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"ampctl: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)

    from ampctl.conf.schema import register_configs

    register_configs()
    module_name, function_name, _ = COMMANDS[command]
    entry = getattr(importlib.import_module(module_name), function_name)
    try:
        if command in ("train", "compare", "memory", "inspect"):
            from ampctl.engine.build import check_config
            from ampctl.preflight import preflight

            # compare and memory check their base config here; each mode is composed and checked later
            check = {"train": check_config, "compare": validate_compare, "memory": validate_memory,
                     "inspect": validate_inspect}[command]
            preflight(rest, command, check)
    except UsageError as exc:
        print(f"ampctl {command}: error: {exc}", file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)
    under_torchrun = False
    if command == "train":
        from ampctl.engine.parallel import (
            NON_MAIN_HYDRA_OVERRIDES,
            is_main_process,
            torchrun_world_size,
        )

        under_torchrun = torchrun_world_size() > 1
        if not is_main_process():
            rest = [*rest, *NON_MAIN_HYDRA_OVERRIDES]
    sys.argv = [f"ampctl-{command}", *rest]
    entry()  # raises SystemExit when the run fails
    if under_torchrun:
        from ampctl.engine.parallel import exit_worker

        exit_worker()
