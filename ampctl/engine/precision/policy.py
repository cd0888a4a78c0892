"""PrecisionPolicy: everything a precision mode changes, in one place.

The data of each mode lives in ampctl/conf/precision/*.yaml; this class turns it into behaviour: the autocast
context, how the model is prepared (cast to half, norm layers kept fp32), the weight layout the optimizer
steps on (fp32 masters for O2), and the global TF32 flags (set for the run, restored afterwards). The loop
never branches on precision: it calls these verbs whatever the mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from torch import nn

from ampctl.conf.options import typed_options
from ampctl.conf.precision_schema import UNCONVERTED, Dtype, LayerRule, PrecisionConfig
from ampctl.engine import devices
from ampctl.engine.precision import converters, fp32_math, layers
from ampctl.engine.precision.grouped_experts import is_grouped_experts
from ampctl.engine.precision.half import FP32MasterWeights, WeightLayout, cast_model_to_half
from ampctl.errors import ConfigError, ModeUnsupported, UsageError

TORCH_DTYPES = {Dtype.float32: torch.float32, Dtype.float16: torch.float16, Dtype.bfloat16: torch.bfloat16}


class PrecisionPolicy:
    """A mode's behaviour, in the verbs of Lightning Fabric's Precision where they exist (convert_module,
    forward_context), and its refusals (check). A context manager for a run: sets the global matmul flags on enter
    and restores them on exit. What a mode means for speed on this machine is said above the engine
    (analysis/mode_advice.py)."""

    def __init__(self, precision: PrecisionConfig, device: torch.device) -> None:
        """precision: the mode's config as its schema dataclass (OmegaConf.to_object of cfg.precision)."""
        self.precision = precision
        self.dtype = TORCH_DTYPES[precision.dtype]  # the half type, or float32 in fp32 and tf32
        self.uses_half = precision.autocast or precision.cast_model
        self.device = device
        self._saved_flags: Optional[dict[str, Any]] = None
        self.converter = converter_of(precision, device)  # None in the flag-driven modes
        self.layer_plan: Optional[layers.LayerPlan] = None  # the rules matched against the model (convert_module)
        self.layer_rows: list[layers.LayerRow] = []  # the resolved precision of every layer
        self._linears = self._grouped = self._grouped_converted = 0

    # --- what the device can do -----------------------------------------------------------------

    def check(self) -> None:
        """Refuse what this device or torch build cannot do, naming what to use instead."""
        s, dev = self.precision, self.device
        if s.tf32 and not devices.has_tf32(dev):
            where = devices.device_name(dev) if dev.type == "cuda" else "a CPU"
            raise ModeUnsupported(
                s.name, "needs TF32 tensor cores (a CUDA GPU of compute capability 8.0+, Ampere or newer)",
                f"; this run is on {where}: use precision=fp32",
                if_bf16_is_fast=", or precision=bf16 for a faster mode")
        if self.converter is not None and (reason := self.converter.unsupported_reason()):
            emulation = self.converter.emulation
            instead = (f"use precision={emulation} to study its numerics on this machine" if emulation
                       else "`ampctl list` says which modes run here")
            raise ModeUnsupported(s.name, reason, f": {instead}",
                                  if_bf16_is_fast=", or precision=bf16 for speed" if emulation else "")
        if not self.uses_half:
            return
        if self.dtype == torch.bfloat16 and not devices.has_native_bf16(dev):
            raise ModeUnsupported(
                s.name, f"with dtype=bfloat16 needs native bf16 support, which {devices.device_name(dev)} lacks",
                "; use precision=fp16 (with its loss scaler) instead")
        if s.autocast and not devices.autocast_works(dev.type, self.dtype):
            raise ModeUnsupported(
                s.name, f"needs {dev.type} autocast for {str(self.dtype).removeprefix('torch.')}, which torch "
                f"{torch.__version__} has not", "; use precision=bf16, or upgrade torch")

    # --- the run ----------------------------------------------------------------------------------

    def __enter__(self) -> "PrecisionPolicy":
        self._saved_flags = fp32_math.snapshot()
        fp32_math.set_tf32(self.precision.tf32)  # "fp32" is true fp32: TF32 is switched off, not left at default
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._saved_flags is not None
        fp32_math.restore(self._saved_flags)
        self._saved_flags = None

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The forward pass's autocast (Fabric's Precision.forward_context). Always a context manager; "off" is
        enabled=False, so the loop has no branch."""
        dtype = self.dtype if self.precision.autocast else torch.bfloat16  # dtype is unused when disabled
        return torch.autocast(self.device.type, dtype=dtype, enabled=self.precision.autocast)

    def convert_module(self, model: nn.Module) -> nn.Module:
        """Move the model to the device and apply the mode's converters and per-layer rules (layers.py): the
        converters' layer swaps (FP8, MX), then the half cast of O2/O3 (half.py) or the rules' dtype scopes (as
        Fabric's Precision.convert_module)."""
        model.to(self.device)
        # the model's own rules after the mode's (model_rules.py): the layer plan's, not the mode's config
        self.layer_plan = plan = layers.plan(model, with_model_rules(self.precision, model), self.converter,
                                             self.device)
        self._linears = sum(isinstance(m, nn.Linear) for m in model.modules())
        self._grouped = sum(is_grouped_experts(m) for m in model.modules())  # a converter converts them too
        self._grouped_converted = sum(is_grouped_experts(model.get_submodule(f)) for f in plan.converted)
        layers.convert(model, plan)
        if self.precision.cast_model:
            cast_model_to_half(model, self.dtype, [f for f, run_in in plan.scopes().items() if run_in == "fp32"],
                               self.device)
        else:
            layers.open_scopes(model, plan, self.device, self.precision.autocast)
        self.layer_rows = layers.table(model, plan, self.precision, self.device)
        return model

    def converts_layers(self) -> bool:
        """Whether some layers compute in a converter's format (by the mode or by a rule), whatever autocast says."""
        return self.converter is not None or (
            bool(self.precision.rules) and any(r.run_in in converters.format_owners() for r in self.precision.rules))

    @property
    def emulated(self) -> bool:
        """Whether any layer computes in an emulated format (by the mode or by a rule): its speed is not the
        format's."""
        return self.layer_plan is not None and any(c.emulated for c, _ in self.layer_plan.converted.values())

    @property
    def converted(self) -> dict[str, str]:
        """The layers a converter swapped, by name: their format."""
        return {} if self.layer_plan is None else {f: fmt for f, (_, fmt) in self.layer_plan.converted.items()}

    def one_step_up(self, layer: str) -> Optional[str]:
        """What `layer` runs in one step up from what it runs in now (a layer computed in a converter's format ->
        unconverted; a half one -> fp32), the step escalation, diff's repair and advise take; None where it
        computes in fp32 already (tf32 included: a rule cannot take TF32 from one layer)."""
        if layer in self.converted:
            return UNCONVERTED
        now = self.layer_plan.run_in(layer) if self.layer_plan is not None else None
        if now == "fp32":
            return None
        if now in ("bf16", "fp16"):
            return "fp32"
        return "fp32" if self.precision.autocast or self.precision.cast_model else None

    def weight_layout(self, model: nn.Module, grad_accum_steps: int = 1) -> WeightLayout:
        """The weights the optimizer steps on; their micro-batch gradients added up in fp32 where
        precision.grad_accum_dtype says so and a step has more than one."""
        in_fp32 = self.precision.grad_accum_dtype == "float32" and grad_accum_steps > 1
        layout = FP32MasterWeights if self.precision.master_weights else WeightLayout
        return layout(model, accumulate_in_fp32=in_fp32)

    def describe(self, scaler_description: str) -> str:
        """The resolved options, printed once at start (as Apex's "Selected optimization level")."""
        s = self.precision
        short = lambda dt: str(dt).removeprefix("torch.")  # noqa: E731
        planned = self.layer_plan.rules if self.layer_plan is not None else s.rules  # the model's own after the mode's
        rules = [layers.rule_text(rule) + (" (the model's)" if i >= len(s.rules) else "")
                 for i, rule in enumerate(planned)]
        parts = [
            f"autocast={short(self.dtype) if s.autocast else 'off'}",
            f"model_weights={short(self.dtype) if s.cast_model else 'float32'}",
            f"master_weights={'float32' if s.master_weights else 'none'}",
            "rules=" + (f"[{'; '.join(rules)}]" if rules else "none"),
            f"tf32={'on' if s.tf32 else 'off'}",
            f"loss_scale={scaler_description}",
        ]
        if self.converter is not None:
            parts.insert(0, self.converter.describe())
        if self.converted:
            parts.insert(1 if self.converter is not None else 0,
                         f"converted={len(self.converted) - self._grouped_converted} of {self._linears} Linear layers"
                         + (f" and {self._grouped_converted} of {self._grouped} grouped experts" if self._grouped
                            else ""))
        return f"Selected precision={s.name}: " + ", ".join(parts)



def converter_of(precision: PrecisionConfig, device: torch.device) -> Optional[converters.Converter]:
    """The mode's converter, made from precision.options typed by its options dataclass (None in the flag-driven
    modes). A converter whose layers run inside autocast refuses a mode without it."""
    if precision.converter is None:
        return None
    cls = converters.converter_class(precision.converter)
    needs = cls.runs_inside_autocast
    if needs is not None and not (precision.autocast and precision.dtype.value == needs):
        raise ConfigError("precision.dtype", precision.dtype.name,
                          f"{needs} with autocast=true under converter={cls.name} (its layers run inside {needs} "
                          "autocast)")
    if cls.options_type is None:
        if precision.options:  # options a converter does not read would be silently ignored
            raise UsageError(f"precision.options: converter {cls.name} takes no options (it names no options_type); "
                             f"given: {', '.join(precision.options)}")
        return cls(None, device)
    options = typed_options("precision.options", precision.options or {}, cls.options_type)
    return cls(OmegaConf.to_object(options), device)


# A model's own precision rules: its class's `ampctl_rules` (the MoE recipe keeps its routers in fp32, as practice
# does), applied after the mode's rules to the layers none of the mode's rules decides, so that a user's rule on one
# of those layers replaces the model's for it (the first rule that matches a layer decides it, and a rule of the
# model's that only an earlier rule's layers match would be refused as contradicting it).

def with_model_rules(precision: PrecisionConfig, model: nn.Module) -> PrecisionConfig:
    """The mode with the model's rules after its own; the mode as it is where every layer computes in fp32 anyway
    (no autocast, no half weights, no converter, no rules)."""
    own: list[LayerRule] = list(getattr(model, "ampctl_rules", None) or [])
    if not own or not (precision.autocast or precision.cast_model or precision.converter or precision.rules):
        return precision
    modules = dict(model.named_modules())
    mode_rules = [rule.counted_from_the_end(list(modules)) for rule in precision.rules]

    def decided_by_the_mode(fqn: str) -> bool:
        ancestors = [fqn] + [fqn.rsplit(".", depth)[0] for depth in range(1, fqn.count(".") + 1)]
        return any(layers.matches(rule, name, modules[name]) for rule in mode_rules for name in ancestors)

    added: list[LayerRule] = []
    for rule in own:
        hits = [fqn for fqn, module in modules.items() if fqn and layers.matches(rule, fqn, module)]
        free = [fqn for fqn in hits if not decided_by_the_mode(fqn)]
        if free == hits:
            added.append(rule)  # as the model says it: the start line shows one rule, not one per layer
        else:
            added += [LayerRule.for_layer(fqn, rule.run_in) for fqn in free]
    return dataclasses.replace(precision, rules=[*precision.rules, *added]) if added else precision
