"""Per-layer precision: the rules of precision.rules matched against the model, checked, applied, and the
resolved precision of every layer as a table (the start line and `ampctl inspect` print it).

A rule matches modules by qualified name (a glob, whose numeric segment may count from the end: `blocks.-1.*`)
and/or by type (a glob over the class names of the module and
its bases, or `norm`), and says what they run in:
- fp32, bf16, fp16: the module's math, whatever the mode: autocast is switched off inside it (fp32, its floating
  inputs cast to fp32) or set to that dtype; under O2/O3 an fp32 layer keeps fp32 weights and its inputs and
  outputs are cast around it (Apex O2's norms, the default rule there);
- unconverted: left out of the mode's converter (FP8, MX): its Linear layers run as the rest of the model does;
- a converter's format (fp8_emulated, mxfp8, mxfp4, nvfp4, fp8): its Linear layers are converted to that format,
  under any mode.
The first rule that matches a module decides it; a module no rule matches runs as its parent does, so a rule on
a container decides everything inside it unless a rule matches something inside. Refused, in one line: a rule
that matches nothing (with the closest names), a rule every layer of which an earlier rule decides otherwise
(contradictory), and a rule the mode or the device cannot honour.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import nn

from ampctl.conf.messages import did_you_mean
from ampctl.conf.precision_schema import LAYER_DTYPES, UNCONVERTED, LayerRule, PrecisionConfig
from ampctl.engine import devices
from ampctl.engine.precision import autocast_ops, converters
from ampctl.engine.precision.grouped_experts import is_grouped_experts
from ampctl.engine.precision.half import cast_floats, is_norm_layer
from ampctl.errors import UsageError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHORT = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def rule_text(rule: LayerRule) -> str:
    """match=head type=Linear run_in=fp32: the rule as a command line would set it."""
    where = " ".join(f"{key}={value}" for key, value in (("match", rule.match), ("type", rule.type)) if value)
    return f"{where} run_in={rule.run_in}"


def describe_rule(index: int, rule: LayerRule) -> str:
    return f"precision.rules[{index}] ({rule_text(rule)})"


def matches(rule: LayerRule, fqn: str, module: nn.Module) -> bool:
    if rule.match is not None and not fnmatch.fnmatchcase(fqn, rule.match):
        return False
    if rule.type is None:
        return True
    if rule.type == "norm":
        return is_norm_layer(module)
    return any(fnmatch.fnmatchcase(cls.__name__, rule.type) for cls in type(module).__mro__
               if cls not in (nn.Module, object))


@dataclass
class LayerPlan:
    """Which rule decides each module (by qualified name; None: the mode's default) and what it runs in."""

    rules: list[LayerRule]
    decided: dict[str, Optional[int]]  # module name -> index of the deciding rule, own or inherited
    own: dict[str, int]  # module name -> index of the first rule that matches the module itself
    converted: dict[str, tuple[converters.Converter, str]]  # module name -> (converter, format)

    def run_in(self, fqn: str) -> Optional[str]:
        index = self.decided.get(fqn)
        return None if index is None else self.rules[index].run_in

    def scopes(self) -> dict[str, str]:
        """The modules that open a dtype scope: their own rule says fp32/bf16/fp16, and their parent's does not
        say the same."""
        out = {}
        for fqn, index in self.own.items():
            run_in = self.rules[index].run_in
            if run_in in DTYPES and self.run_in(_parent(fqn)) != run_in:
                out[fqn] = run_in
        return out


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def plan(model: nn.Module, precision: PrecisionConfig, converter: Optional[converters.Converter],
         device: torch.device) -> LayerPlan:
    """Match the rules against the model and check them; refuse, in one line, what cannot be honoured."""
    names = [fqn for fqn, _ in model.named_modules()]
    rules = [rule.counted_from_the_end(names) for rule in precision.rules]
    owners = converters.format_owners() if rules else {}  # (loads every converter: only where a rule may name one)
    for index, rule in enumerate(rules):
        _check_run_in(index, rule, owners, precision, converter, device)
    own: dict[str, int] = {}
    hits: list[list[str]] = [[] for _ in rules]
    modules = dict(model.named_modules())
    for fqn, module in modules.items():
        found = [index for index, rule in enumerate(rules) if matches(rule, fqn, module)]
        for index in found:
            hits[index].append(fqn)
        if found:
            own[fqn] = found[0]
    for index, rule in enumerate(rules):
        _check_matched(index, rule, hits[index], own, rules, modules)
    decided: dict[str, Optional[int]] = {}
    for fqn in modules:  # named_modules lists a parent before its children
        decided[fqn] = own[fqn] if fqn in own else decided.get(_parent(fqn)) if fqn else None
    layer_plan = LayerPlan(rules, decided, own, {})
    layer_plan.converted = _conversions(layer_plan, modules, owners, converter, device)
    _check_effects(layer_plan, modules, owners, hits, device)
    if converter is not None and not layer_plan.converted and converter.wants(model, ""):
        # the model object is the caller's: a converter swaps layers inside it, never the model itself
        kind = type(model).__name__
        raise UsageError(f"precision={precision.name}: the model is itself one {kind}, and the mode converts the "
                         f"{kind} layers inside a model, so it would run as fp32: return it inside a container from "
                         f"build_model (nn.Sequential({kind}(...)))")
    if converter is not None:
        converter.check_converted([f for f, (c, _) in layer_plan.converted.items() if c is converter],
                                  sum(isinstance(m, nn.Linear) for m in modules.values()))
    return layer_plan


def _check_effects(layer_plan: LayerPlan, modules: dict[str, nn.Module], owners: dict[str, type],
                   hits: list[list[str]], device: torch.device) -> None:
    """Refuse a rule that would change nothing: a format or unconverted rule that decides no Linear layer, a bf16 or
    fp16 rule that decides no layer autocast runs in a low-precision type on this device (a norm on a CPU runs in
    its input's dtype whatever autocast's)."""
    for index, rule in enumerate(layer_plan.rules):
        decides = [f for f in modules if layer_plan.decided[f] == index]
        if rule.run_in in DTYPES and rule.run_in != "fp32":
            kinds = {f: autocast_ops.under_autocast(modules[f], device.type, DTYPES[rule.run_in]) for f in decides}
            if not {autocast_ops.LOWER, autocast_ops.PER_OP} & set(kinds.values()):
                shown = ", ".join(f"{f} ({type(modules[f]).__name__}: {kinds[f]})" for f in decides[:3])
                raise UsageError(f"{describe_rule(index, rule)}: torch.autocast on {device.type} runs none of the "
                                 f"layers it decides in {SHORT[DTYPES[rule.run_in]]} ({shown}"
                                 f"{' and more' if len(decides) > 3 else ''}; as input: autocast leaves that op in "
                                 "the dtype it is given), so the rule would change nothing; run_in=fp32 makes them "
                                 "fp32")
        if rule.run_in in owners and not any(f in layer_plan.converted for f in decides):
            raise UsageError(f"{describe_rule(index, rule)}: {rule.run_in} converts nn.Linear layers, and none of the "
                             f"layers it matches is or holds one ({_names(hits[index])})")
        if rule.run_in == UNCONVERTED and not any(isinstance(modules[f], nn.Linear) or is_grouped_experts(modules[f])
                                                  for f in decides):
            raise UsageError(f"{describe_rule(index, rule)}: none of the layers it matches is or holds an nn.Linear, "
                             f"the layers a converter converts ({_names(hits[index])})")


def _check_run_in(index: int, rule: LayerRule, owners: dict[str, type[converters.Converter]],
                  precision: PrecisionConfig, converter: Optional[converters.Converter], device: torch.device) -> None:
    said = describe_rule(index, rule)
    if rule.run_in not in DTYPES and rule.run_in != UNCONVERTED and rule.run_in not in owners:
        choices = [*LAYER_DTYPES, UNCONVERTED, *sorted(owners)]
        raise UsageError(f"{said}: no such run_in{did_you_mean(rule.run_in, choices)}; choose "
                         f"{', '.join(LAYER_DTYPES)}, {UNCONVERTED} or a format: {', '.join(sorted(owners))}")
    mode = f"precision={precision.name}"
    if rule.run_in in DTYPES and rule.run_in != "fp32":
        dtype = DTYPES[rule.run_in]
        if precision.cast_model and SHORT[dtype] != precision.dtype.name:
            raise UsageError(f"{said}: {mode} stores the model's weights in {precision.dtype.name}, and a "
                             f"{rule.run_in} layer would need weights of its own; use this rule under precision=bf16 "
                             "or fp16 (autocast over fp32 weights)")
        if not devices.autocast_works(device.type, dtype) or (dtype == torch.bfloat16
                                                                and not devices.has_native_bf16(device)):
            raise UsageError(f"{said}: {devices.device_name(device)} cannot run {SHORT[dtype]} autocast")
    if rule.run_in in owners:
        if precision.cast_model:
            raise UsageError(f"{said}: {mode} casts the model's weights to {precision.dtype.name}, and a converted "
                             "layer keeps fp32 weights; use the rule under a mode with fp32 weights (fp32, bf16, fp16)")
        cls = owners[rule.run_in]
        if converter is None or type(converter) is not cls:
            reason = cls(None, device).unsupported_reason()
            if reason:
                raise UsageError(f"{said}: {rule.run_in} {reason}")
    if rule.run_in == UNCONVERTED and converter is None and not any(r.run_in in owners for r in precision.rules):
        raise UsageError(f"{said}: {mode} converts no layers, so there is nothing to leave out; the rule is for "
                         "the converter modes (FP8, MX: `ampctl list`) and beside format rules")


def _check_matched(index: int, rule: LayerRule, hits: list[str], own: dict[str, int], rules: list[LayerRule],
                   modules: dict[str, nn.Module]) -> None:
    said = describe_rule(index, rule)
    if not hits:
        raise UsageError(f"{said} matches no layer of this model; {_closest(rule, modules)}")
    deciders = {own[fqn] for fqn in hits}
    if index not in deciders:
        earlier = min(deciders)
        if all(rules[own[fqn]].run_in != rule.run_in for fqn in hits):
            raise UsageError(f"{said} contradicts {describe_rule(earlier, rules[earlier])}, which matches every layer "
                             f"it matches first ({_names(hits)}): the first matching rule decides a layer; drop one, "
                             "or narrow the earlier rule")


def _closest(rule: LayerRule, modules: dict[str, nn.Module]) -> str:
    if rule.match is not None:
        names = [fqn for fqn in modules if fqn]
        close = difflib.get_close_matches(rule.match, names, n=3, cutoff=0.4) or names[:3]
        return f"the closest layer names: {', '.join(close)}"
    types = sorted({type(m).__name__ for m in modules.values()})
    close = difflib.get_close_matches(rule.type or "", types, n=3, cutoff=0.4) or types[:3]
    return f"the closest layer types: {', '.join(close)} (type=norm: every normalization layer)"


def _names(fqns: list[str], limit: int = 3) -> str:
    shown = ", ".join(fqns[:limit])
    return shown + (f" and {len(fqns) - limit} more" if len(fqns) > limit else "")


def _conversions(layer_plan: LayerPlan, modules: dict[str, nn.Module], owners: dict[str, type[converters.Converter]],
                 converter: Optional[converters.Converter], device: torch.device
                 ) -> dict[str, tuple[converters.Converter, str]]:
    """Which modules a converter swaps, and into which format: a format rule's, or the mode's where it wants them."""
    instances: dict[type, converters.Converter] = {type(converter): converter} if converter is not None else {}
    chosen: dict[str, tuple[converters.Converter, str]] = {}
    for fqn, module in modules.items():
        if not fqn:
            continue
        run_in = layer_plan.run_in(fqn)
        if run_in in owners:
            cls = owners[run_in]
            instance = instances.setdefault(cls, cls(None, device))
            if instance.can_convert(module):
                chosen[fqn] = (instance, run_in)
        elif run_in is None and converter is not None and converter.wants(module, fqn):
            chosen[fqn] = (converter, converter.default_format())
    return chosen


def convert(model: nn.Module, layer_plan: LayerPlan) -> None:
    """Swap the chosen modules, each converter its own."""
    by_converter: dict[int, tuple[converters.Converter, dict[str, str]]] = {}
    for fqn, (converter, fmt) in layer_plan.converted.items():
        by_converter.setdefault(id(converter), (converter, {}))[1][fqn] = fmt
    for converter, chosen in by_converter.values():
        converter.convert_model(model, chosen)


class PrecisionScope:
    """Mixed into a module's class by a dtype rule: its forward runs with autocast off and fp32 inputs (fp32), or
    under autocast in the rule's dtype; in a mode without autocast its outputs return to fp32. The class keeps its
    name, parameters and state_dict; print shows the rule (run_in=...)."""

    ampctl_run_in: str
    ampctl_device_type: str
    ampctl_outputs_fp32: bool

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dtype = DTYPES[self.ampctl_run_in]
        if dtype == torch.float32:
            with torch.autocast(self.ampctl_device_type, enabled=False):
                return super().forward(*cast_floats(args, dtype), **cast_floats(kwargs, dtype))  # type: ignore[misc]
        with torch.autocast(self.ampctl_device_type, dtype=dtype):
            out = super().forward(*args, **kwargs)  # type: ignore[misc]
        return cast_floats(out, torch.float32) if self.ampctl_outputs_fp32 else out

    def extra_repr(self) -> str:
        inner = super().extra_repr()  # type: ignore[misc]
        return f"{inner}, run_in={self.ampctl_run_in}" if inner else f"run_in={self.ampctl_run_in}"


_SCOPED: dict[type, type] = {}


def _scoped_class(cls: type) -> type:
    if cls not in _SCOPED:
        _SCOPED[cls] = type(cls.__name__, (PrecisionScope, cls), {"__module__": cls.__module__,
                                                                  "__qualname__": cls.__qualname__})
    return _SCOPED[cls]


def open_scopes(model: nn.Module, layer_plan: LayerPlan, device: torch.device, autocast: bool) -> None:
    """The dtype rules of a mode over fp32 weights (fp32, tf32, autocast, converters): each ruled module's class
    gains the scope."""
    for fqn, run_in in layer_plan.scopes().items():
        module = model.get_submodule(fqn)
        if run_in == "fp32" and not autocast:
            continue  # already fp32 math: nothing to switch off
        module.__class__ = _scoped_class(type(module))
        module.ampctl_run_in, module.ampctl_device_type, module.ampctl_outputs_fp32 = run_in, device.type, not autocast


# --- the table -------------------------------------------------------------------------------------------------


@dataclass
class LayerRow:
    layer: str  # the name, its indices folded to * when several layers share the row
    type: str
    compute: str
    weights: str
    converter: str
    rule: str
    count: int = 1
    names: list[str] = field(default_factory=list)  # the layers' own names


def table(model: nn.Module, layer_plan: LayerPlan, precision: PrecisionConfig, device: torch.device
          ) -> list[LayerRow]:
    """The resolved precision of every layer that holds parameters or that a rule names, layers that differ only
    in their index (blocks.0.attn, blocks.1.attn) folded into one row (blocks.*.attn x2)."""
    rows: dict[tuple, LayerRow] = {}  # in the order each kind of row first appears
    for fqn, module in model.named_modules():
        holds_weights = next(module.parameters(recurse=False), None) is not None
        if not fqn or not (holds_weights or (fqn in layer_plan.own and next(module.children(), None) is None)):
            continue  # the layers that hold weights, and weightless leaves a rule names (a softmax module)
        index = layer_plan.decided.get(fqn)
        converted = layer_plan.converted.get(fqn)
        row = LayerRow(re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", fqn), type(module).__name__,
                       _compute(module, layer_plan.run_in(fqn), converted, precision, device), _weights(module),
                       f"{converted[0].name}" if converted else "-",
                       "mode" if index is None else f"rules[{index}]" if index < len(precision.rules) else "model's",
                       names=[fqn])
        key = (row.layer, row.type, row.compute, row.weights, row.converter, row.rule)
        if key in rows:
            rows[key].count += 1
            rows[key].names.append(fqn)
        else:
            rows[key] = row
    return list(rows.values())


def _compute(module: nn.Module, run_in: Optional[str], converted: Optional[tuple[converters.Converter, str]],
             precision: PrecisionConfig, device: torch.device) -> str:
    """What the module computes in, as autocast on this device type decides it (autocast_ops): its dtype, float32,
    `as input` (an op autocast leaves alone: a norm on a CPU) or `per op` (a type of its own)."""
    if converted is not None:
        return converted[1] + (" (emulated)" if converted[0].emulated else "")
    if run_in == "fp32":
        return "float32"  # autocast off and its inputs cast to fp32 (layers.PrecisionScope, half.py under O2/O3)
    low = DTYPES[run_in] if run_in in DTYPES else getattr(torch, precision.dtype.name) if precision.autocast else None
    if low is not None:
        what = autocast_ops.under_autocast(module, device.type, low)
        return {autocast_ops.LOWER: SHORT[low], autocast_ops.FP32: "float32"}.get(what, what)
    if precision.cast_model:
        return _weights(module)
    return "tf32" if precision.tf32 else "float32"


def _weights(module: nn.Module) -> str:
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters(recurse=False)})
    return ", ".join(dtypes) or "-"


def _folded(names: list[str]) -> str:
    """blocks.0.mlp.0, blocks.0.mlp.2 -> blocks.0.mlp.*: the parts that differ, starred."""
    parts = [name.split(".") for name in names]
    return ".".join(p[0] if len(set(p)) == 1 else "*" for p in zip(*parts))


def display_name(row: LayerRow) -> str:
    """The row's layer as the table shows it: its own name, or the folded names and how many (blocks.*.attn x12)."""
    return _folded(row.names) + (f" x{row.count}" if row.count > 1 else "")


def render(rows: list[LayerRow]) -> list[str]:
    """The table as aligned text lines (the start line's, in the console and train.log), and what its words mean. A
    column that says the same of every layer is said once below it, and the converter's where the compute column
    names it already (fp8_emulated's table was 118 columns wide, every row two lines at 80)."""
    header = ("layer", "type", "compute", "weights", "converter", "rule")
    cells = [header] + [(display_name(r), r.type, r.compute, r.weights, r.converter,
                         r.rule) for r in rows]
    shown, said = list(range(len(header))), []
    converter, rule, weights = 4, 5, 3
    if all(c[converter] == "-" or c[2].split(" ")[0] == c[converter] for c in cells[1:]):
        shown.remove(converter)  # the format the compute column names is its converter's
    for column in (weights, rule):
        values = {c[column] for c in cells[1:]}
        if len(cells) > 2 and len(values) == 1:
            shown.remove(column)
            value = values.pop()
            said.append("rule: none, the mode decides every layer" if column == rule and value == "mode" else
                        f"{header[column]}: {value}, every layer")
    widths = {i: max(len(row[i]) for row in cells) for i in shown}
    return ["  ".join(row[i].ljust(widths[i]) for i in shown).rstrip() for row in cells] + said + \
        legend(r.compute for r in rows)


def legend(computes: Iterable[str]) -> list[str]:
    """What `as input` and `per op` mean, where the table's compute column says them."""
    said = set(computes)
    return ([f"{autocast_ops.AS_INPUT}: torch.autocast on this device leaves the op in the dtype it is given (the "
             "previous layer's output)"] if autocast_ops.AS_INPUT in said else []) + \
        ([f"{autocast_ops.PER_OP}: a layer type of its own; autocast decides each op its forward calls"]
         if autocast_ops.PER_OP in said else [])
