"""`ampctl export PATH [export.dtype=...] [export.format=...] [export.weights=...] [export.dir=...]`: a checkpoint's
weights in the dtype they are served in (runner/export.py). A bad argument, a checkpoint that fails its check or a
directory that exists is one line, exit 2, nothing written."""

from __future__ import annotations

import sys
from pathlib import Path

from ampctl.shell.outcomes import refuse

USAGE = ("usage: ampctl export PATH [export.dtype=float32|bfloat16|float16] [export.format=safetensors|pt|hf] "
         "[export.weights=model|ema] [export.dir=DIR]   (PATH: a run directory or a checkpoint)")


def complete(done: list[str], current: str) -> list[str]:
    """Shell completion: PATH first (the shell's own file names), then export.KEY= and each key's values."""
    from ampctl.conf.export_schema import DTYPES, FORMATS, WEIGHTS

    if not done:
        return []
    values = {"export.dtype": DTYPES, "export.format": FORMATS, "export.weights": WEIGHTS}
    key, typed_equals, _ = current.partition("=")
    if typed_equals and key in values:
        return [f"{key}={value}" for value in values[key]]
    return [f"{key}=" for key in (*values, "export.dir")]


def main() -> None:
    args = sys.argv[1:]
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return
    if not args or "=" in args[0]:
        refuse("export", "expected PATH first (a run directory or a checkpoint), then export.KEY=VALUE overrides"
               + (f"; got {args[0]!r}" if args else ""))
    path, overrides = args[0], args[1:]
    from ampctl.conf.export_schema import ExportConfig

    options = ExportConfig.from_overrides(overrides)
    from ampctl.runner.export import export  # torch: imported for an export, not for its usage line

    exported = export(Path(path), options)  # a full disk, a read-only directory: nothing was written
    from ampctl import io

    print(f"exported {exported.parameters:,} parameters ({io.format_bytes(exported.bytes)}) to {exported.path}")
