"""ampctl from Python (a notebook, a script): the same configs, overrides and checks as the command line, and
the result back as a value. One function per command that has one (its record's `api`: shell/command.py).

    import ampctl

    run = ampctl.train(["recipe=mlp", "precision=bf16", "train.steps=100"])
    run.summary["final_loss"], run.run_dir
    table = ampctl.compare(["recipe=mlp", "train.steps=50", "compare.precisions=[fp32,bf16]"])
    ranges = ampctl.inspect(["recipe=mlp", "precision=fp16"])
    memory = ampctl.memory(["recipe=gpt", "memory.precisions=[fp32,bf16]"])
    advice = ampctl.advise(["recipe=mlp", "advise.budget=5m"])
    served = ampctl.export(run.run_dir, ["export.dtype=bfloat16"])

Overrides are Hydra's, as typed after the command (`key=value`, `group=option`); `config_dir` is the command
line's `-cd` (your own configs and recipes), `config_name` its `-cn`. A bad value raises
ampctl.errors.UsageError with the one line the command line would print; a run that a guard stopped raises
ampctl.errors.RunStopped. Each call writes the directory the command would (`run_dir`/`out_dir` to choose it).
A sweep (`-m`) stays the command line's: call train() once per setting instead.
"""

from __future__ import annotations

from typing import Any, Callable

from ampctl.shell.result import Result


def functions() -> dict[str, Callable[..., Any]]:
    """Every command's Python API function, by the command's name."""
    from ampctl.shell.command import registry

    return {name: command.api for name, command in registry().items() if command.api is not None}


def __getattr__(name: str) -> Any:
    found = functions().get(name)
    if found is None:
        raise AttributeError(f"module 'ampctl.api' has no attribute {name!r}")
    return found


__all__ = ["Result", "functions"]
