"""Model converters: the precision modes that swap layers rather than set flags, registered by name.

A flag-driven mode (fp32, tf32, fp16, bf16, O1-O3) is a YAML row of ampctl/conf/precision/ and nothing else. A
converter-style mode is one YAML file that names its converter (`converter: <name>`) and one module that
defines the converter: a Converter subclass decorated with @register_converter, as torchtitan registers its
model converters. Its formats (what a per-layer rule may ask for: `run_in: mxfp4`) are then known everywhere
a mode or format is named: the policy's refusals and start line, `ampctl list`, the layer table, messages.

The built-in converters are listed by module below and imported when first looked up (a run that uses none
imports none); converters of other packages register through the `ampctl.converters` entry-point group; one's
own, in a module beside one's configs, is named in its mode's YAML by its dotted path (`converter:
my_fp4.Fp4Converter`), or registered by importing its module before ampctl composes the config (a test does that).
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from ampctl.conf.messages import did_you_mean
from ampctl.errors import UsageError

# The built-in converters, by name, and the module that registers each.
BUILT_IN = {
    "fp8_emulated": "ampctl.engine.precision.fp8_emulated",
    "fp8_torchao": "ampctl.engine.precision.fp8_torchao",
    "mx_emulated": "ampctl.engine.precision.mx_emulated",
}
ENTRY_POINT_GROUP = "ampctl.converters"
_REGISTRY: dict[str, type["Converter"]] = {}


class Converter:
    """What a converter-style precision mode does, in the verbs the policy calls.

    Subclasses set the class attributes and override the methods that differ from these defaults. One
    instance serves a run: made from the mode's options (precision.options as an options_type, or its defaults
    when the mode is another one and a per-layer rule asks for one of this converter's formats).
    """

    name: ClassVar[str]  # the registry's key, and the YAML's `converter:` value
    options_type: ClassVar[Optional[type]] = None  # its options' dataclass: precision.options's keys, their types and
    # defaults (the defaults serve a rule that asks for one of its formats under another mode)
    formats: ClassVar[tuple[str, ...]]  # the formats it computes in, as per-layer rules and the table name them
    matmul_dtype: ClassVar[str] = "float32"  # the matmul dtype whose peak FLOPs its layers run at (flops.py)
    emulated: ClassVar[bool] = False  # its speed is not the format's speed (said wherever a speed is shown)
    emulation: ClassVar[Optional[str]] = None  # the mode that studies its numerics where it cannot run
    shards_with_fsdp: ClassVar[bool] = True  # its layers can be sharded by distributed=fsdp
    checkpoint_state: ClassVar[str] = "nothing beyond the model's weights"  # what its layers add to checkpoints
    runs_inside_autocast: ClassVar[Optional[str]] = None  # the autocast dtype its layers need around them, if any

    def __init__(self, options: Any, device: torch.device) -> None:
        self.options = options if options is not None or self.options_type is None else self.options_type()
        self.device = device
        self.sharded = False  # FSDP2 will shard the model it converts (shard_with_fsdp)

    def default_format(self) -> str:
        """The format the mode computes its converted layers in (a rule may choose another of `formats`)."""
        return self.formats[0]

    def unsupported_reason(self) -> Optional[str]:
        """Why it cannot run on this device or torch build (None when it can): completes 'precision=X ...'."""
        return None

    def wants(self, module: nn.Module, fqn: str) -> bool:
        """Whether the mode converts this module when no rule says otherwise."""
        return self.can_convert(module)

    def can_convert(self, module: nn.Module) -> bool:
        """Whether this module is of a kind it converts at all (a rule asking for more is refused)."""
        return type(module) is nn.Linear

    def convert(self, module: nn.Module, fqn: str, fmt: str) -> nn.Module:
        """The module that replaces `module` (of a kind can_convert accepts), computing in `fmt`."""
        raise NotImplementedError

    def convert_model(self, model: nn.Module, chosen: dict[str, str]) -> None:
        """Swap the chosen modules ({qualified name: format}) in place; one at a time by default."""
        for fqn, fmt in chosen.items():
            parent, _, child = fqn.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(owner, child, self.convert(getattr(owner, child), fqn, fmt))

    def check_converted(self, converted: list[str], linears: int) -> None:
        """Refuse a run in which the mode converted too little to be what its name says."""

    def describe(self) -> str:
        """Its resolved options, for the start line ("fp8=emulated scaling=current ...")."""
        return f"converter={self.name}"

    def slow_here(self) -> Optional[str]:
        """Why it runs much slower than fp32 here, in a few words; None if it does not."""
        return "emulated, by design" if self.emulated else None

    def speed_warnings(self, compiled: bool) -> list[str]:
        """Legal runs that will be much slower than the user likely expects."""
        return []

    def shard_with_fsdp(self, model: nn.Module) -> None:
        """Called before its layers are chosen, where FSDP2 will shard the model (engine/build.py)."""
        self.sharded = True

    def at_step(self, step: int) -> None:
        """Called before each training step's first forward with its number (1, 2, ...): what a converter that draws
        random bits keys them with, so that a resumed run draws as the uninterrupted one did."""

    def weights_changed(self, model: nn.Module) -> None:
        """Called whenever the weights changed: after every optimizer step, and as an evaluation swaps the weight
        average in and out; on every rank, reading nothing from the device."""


class ConvertedLinear(nn.Linear):
    """An nn.Linear whose matmuls a converter computes in another format. A real module class (not a patched
    forward), so print, copy.deepcopy and state_dict see what computes; built from a Linear, it shares that
    Linear's parameters, so the optimizer and checkpoints hold the same weights under the same names."""

    def setup(self) -> None:
        """Called once the weights are in place (on their device): register buffers, build quantizers."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options: Any) -> "ConvertedLinear":
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta", **options)
        new.weight, new.bias = linear.weight, linear.bias
        new.setup()
        return new


def register_converter(cls: type[Converter]) -> type[Converter]:
    """Class decorator: make a converter known by its name. A second class under a taken name is refused."""
    taken = _REGISTRY.get(cls.name)
    if taken is not None and taken is not cls and taken.__qualname__ != cls.__qualname__:
        raise ValueError(f"converter name {cls.name!r} is taken by {taken.__module__}.{taken.__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def unregister_converter(name: str) -> None:
    """Forget a converter (a test's own, when the test is done)."""
    _REGISTRY.pop(name, None)


def _load_all() -> None:
    for module in BUILT_IN.values():
        importlib.import_module(module)
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        register_converter(entry.load())


def registered() -> dict[str, type[Converter]]:
    """Every converter, built-in or registered, by name."""
    _load_all()
    return dict(_REGISTRY)


def converter_class(name: str) -> type[Converter]:
    """The converter registered under name, or the Converter subclass a dotted path names (`my_fp4.Fp4Converter`:
    a module of one's own beside one's configs, which `-cd` makes importable); a UsageError naming the registered
    ones otherwise."""
    if name in BUILT_IN and name not in _REGISTRY:
        importlib.import_module(BUILT_IN[name])
    if name not in _REGISTRY and "." in name:
        return _imported(name)
    if name not in _REGISTRY:
        names = sorted(registered())
        raise UsageError(f"precision.converter={name}: no such converter{did_you_mean(name, names)}; registered: "
                         f"{', '.join(names)} (a package adds one through the {ENTRY_POINT_GROUP!r} entry points)")
    return _REGISTRY[name]


def _imported(path: str) -> type[Converter]:
    module, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"precision.converter={path}: cannot be imported: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Converter)):
        raise UsageError(f"precision.converter={path}: not a Converter subclass "
                         "(ampctl.engine.precision.converters.Converter)")
    return register_converter(cls)


def format_owners() -> dict[str, type[Converter]]:
    """Every converter format (what a rule's run_in may name), and the converter that computes in it."""
    return {fmt: cls for cls in registered().values() for fmt in cls.formats}
