"""`ampctl export PATH [export.dtype=...] [export.format=...] [export.weights=...] [export.dir=...]`: a checkpoint's
weights in the dtype they are served in (runner/checkpointing/export.py). Its settings are composed from
conf/export.yaml as every
command's are. A bad argument, a checkpoint that fails its check or a directory that exists is one line, exit 2,
nothing written."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ampctl.conf.export_schema import ExportAppConfig, ExportDtype, ExportFormat, ExportWeights
from ampctl.errors import OneLineArgumentParser, UsageError
from ampctl.shell.command import Command, Section
from ampctl.shell.python_api import PathLike, Result

if TYPE_CHECKING:
    from ampctl.conf.export_schema import ExportConfig

SUMMARY = "a checkpoint's weights in the dtype you serve: safetensors, pt or a transformers directory"
SETTINGS = {"export.dtype": ExportDtype, "export.format": ExportFormat, "export.weights": ExportWeights}
KEYS = "\n".join([
    "export.KEY=VALUE:",
    *(f"  {key + '=':<21}{'|'.join(v.value for v in kind)}" for key, kind in SETTINGS.items()),
    "  export.dir=          a directory that does not exist (default RUN/exports/...)",
    "  export.max_file_mb=  MiB at most per file of a sharded checkpoint (5000)",
    "  export.consolidate=  true|false: join the ranks' parts (torchrun; true)",
])


def arguments() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="ampctl export", usage="ampctl export [-h] PATH [export.KEY=VALUE ...]",
                                   description=SUMMARY[0].upper() + SUMMARY[1:] + ".",
                                   epilog=KEYS, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", metavar="PATH",  # its absence is said in main, as a key given first is
                        help="a run directory or a checkpoint (under torchrun: a sharded one, each rank its part)")
    settings = parser.add_argument("overrides", nargs="*", metavar="export.KEY=VALUE", help="the export's settings")
    settings.completer = _settings
    return parser


def _settings(current: str) -> list[str]:
    """export.KEY= and, once a key's = is typed, its values."""
    key, typed_equals, _ = current.partition("=")
    if typed_equals and key in SETTINGS:
        return [f"{key}={value.value}" for value in SETTINGS[key]]
    if typed_equals and key == "export.consolidate":
        return [f"{key}={value}" for value in ("true", "false")]
    return [f"{key}=" for key in (*SETTINGS, "export.dir", "export.max_file_mb", "export.consolidate")]


def export_settings(overrides: Sequence[str]) -> "ExportConfig":
    """export.* composed from conf/export.yaml with the command line's overrides; a bad key or value: UsageError."""
    from omegaconf import OmegaConf

    from ampctl.conf.messages import one_line
    from ampctl.shell.hydra_internals import composed

    try:
        with composed("export", list(overrides)) as cfg:
            return OmegaConf.to_object(cfg.export)  # type: ignore[return-value]
    except UsageError:
        raise
    except Exception as exc:  # Hydra's and OmegaConf's multi-line errors, as one line
        raise UsageError(one_line(exc)) from None


def main() -> None:
    args = arguments().parse_args(sys.argv[1:])  # --help wherever it stands; a bad argument is one line, exit 2
    if args.path is None or "=" in args.path:
        raise UsageError("expected PATH first (a run directory or a checkpoint), then export.KEY=VALUE overrides"
                         + (f"; got {args.path!r}" if args.path else ""))
    settings = export_settings(args.overrides)
    from ampctl import io
    from ampctl.runner.checkpointing.export import export  # torch: imported for an export, not for its usage line

    exported = export(Path(args.path), settings)  # a full disk, a read-only directory: nothing was written
    if exported.is_main:
        print(f"exported {exported.parameters:,} parameters ({io.format_bytes(exported.bytes)}) to {exported.path}")


def export_from_python(path: PathLike, overrides: Sequence[str] = ()) -> Result:
    """`ampctl export PATH [export.dtype=... ...]`: a checkpoint's weights (PATH: a run directory or a checkpoint)
    in the dtype you serve; returns the export's directory and its export.json."""
    from ampctl.runner.checkpointing.export import RECORD, export

    exported = export(Path(path), export_settings(overrides), say=lambda _line: None)
    return Result(exported.path, json.loads((exported.path / RECORD).read_text()))


export_from_python.__name__ = export_from_python.__qualname__ = "export"

COMMAND = Command(name="export", summary=SUMMARY, section=Section.FILES, main=main, api=export_from_python,
                  schema=ExportAppConfig, arguments=arguments)
