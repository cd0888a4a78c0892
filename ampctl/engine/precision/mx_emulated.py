"""Emulated microscaling formats (precision=mxfp8, mxfp4, nvfp4): every nn.Linear's three matmuls take inputs
quantized block by block and dequantized back to fp32; the matmuls themselves run in fp32. Slow by design: the
emulation studies the formats' numerics on any machine, and its speed is not theirs.

The formats (docs/precision.md has the tables):
- MXFP8 and MXFP4, OCP Microscaling Formats (MX) v1.0: blocks of 32 elements (E4M3 or E5M2; E2M1) share one
  E8M0 scale, a power of two 2^(e-127), e in 0..254, 255 being NaN. The spec's scale is
  2^(floor(log2(amax)) - emax_elem) (scale_mode=floor); torchao also offers ceil, even, and NVIDIA's rceil
  (2^ceil(log2(amax / max_elem)), as cuBLAS and Transformer Engine round). Elements are rounded to nearest even and
  saturate at the format's max.
- NVFP4, NVIDIA: blocks of 16 E2M1 elements share an E4M3 scale (amax / 6, rounded to E4M3), under one fp32 scale
  per tensor (amax / (448 * 6)), so that the block scales use E4M3's whole range.
Every number here is computed as torchao.prototype.mx_formats computes it (to_mx, nvfp4_quantize), and the tests
compare the two bit for bit, including torchao's choices the specifications leave open: a block whose amax is NaN
gets the NaN scale; an infinite amax saturates (floor/ceil/even: the largest scale 2^127; rceil: code 254); under
floor/ceil/even an all-zero or tiny block (scale code 0, 2^-127) is divided by 2^-126 when quantized (fp32's
smallest normal, as torchao does to stay out of subnormals) and decoded with 2^-127. One deliberate difference:
an all-zero tensor under NVFP4's per-tensor scale is quantized to zeros (torchao's 0/0 gives NaN).

Blocks run along the reduction dimension of the matmul each operand enters, as torchao's MX training (mx_mm) and
Transformer Engine lay them out: activations and weights along K in the forward; the output gradient and the
weight along N for the input gradient; the output gradient and the activations along the tokens (M) for the
weight gradient. A dimension that is not a multiple of the block is padded with zeros, which leave each block's
amax unchanged (torchao refuses such shapes; real kernels pad too). The quantization itself is
block_quantize.py's; NVFP4's training recipe (2D weight blocks, RHT, stochastic rounding) nvfp4_recipe.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional

import torch
from torch import nn

from ampctl.conf.value_checks import require
from ampctl.engine.precision import mx_torchao, nvfp4_recipe
from ampctl.engine.precision.block_quantize import ELEMENTS, BlockFormat, MXScaleMode, fake_quantize
from ampctl.engine.precision.converters import ConvertedLinear, Converter, register_converter
from ampctl.engine.precision.grouped_experts import PerExpertLinear, is_grouped_experts, mix_into


class MXFormat(Enum):
    mxfp8 = "mxfp8"  # OCP MX: 8-bit elements (E4M3 or E5M2), blocks of 32, E8M0 scales
    mxfp4 = "mxfp4"  # OCP MX: E2M1 elements, blocks of 32, E8M0 scales
    nvfp4 = "nvfp4"  # NVIDIA: E2M1 elements, blocks of 16, E4M3 scales and an fp32 per-tensor scale


class MXKernels(Enum):
    emulated = "emulated"  # ampctl's emulation (observable: inspect, telemetry.blocks_every; every format and rule)
    torchao = "torchao"  # torchao's MXFP8 training layer: its kernels on sm100, its emulated reference elsewhere
    auto = "auto"  # torchao's kernels where the GPU has them, else ampctl's emulation


class MXElements(Enum):
    e4m3 = "e4m3"
    e5m2 = "e5m2"


@dataclass
class MXEmulatedOptions:
    """The emulated microscaling formats of Linear layers (ampctl/engine/precision/mx_emulated.py)."""

    format: MXFormat = MXFormat.mxfp8
    elements: MXElements = MXElements.e4m3  # mxfp8: the elements of activations and weights
    grad_elements: MXElements = MXElements.e4m3  # mxfp8: the elements of gradients (e5m2: more range, less precision)
    scale_mode: MXScaleMode = MXScaleMode.floor  # mxfp8, mxfp4: how each block's E8M0 scale is rounded
    per_tensor_scale: bool = True  # nvfp4: the second-level fp32 scale from each tensor's amax
    # NVFP4's training recipe (nvfp4_recipe.py; precision=nvfp4_recipe sets all three): one E4M3 scale per 16x16
    # block of a weight (the forward's W and the input gradient's W^T the same values); random Hadamard transforms
    # on the weight gradient's two inputs along the tokens; gradients rounded to E2M1 stochastically
    weights_2d: bool = False
    rht: bool = False
    stochastic_rounding: bool = False
    # mxfp8: whose layers compute it (mx_torchao.py): ampctl's emulation, torchao's MXFP8 training layer, or auto
    kernels: MXKernels = MXKernels.emulated

    def __post_init__(self) -> None:
        if self.format != MXFormat.mxfp8:
            for key in ("elements", "grad_elements"):
                require(getattr(self, key) == MXElements.e4m3, f"precision.options.{key}", getattr(self, key).name,
                        f"e4m3 (the default) with format={self.format.name}, whose elements are E2M1")
        if self.format == MXFormat.nvfp4:
            require(self.scale_mode == MXScaleMode.floor, "precision.options.scale_mode", self.scale_mode.name,
                    "floor (the default) with format=nvfp4, whose block scales are E4M3, not E8M0")
        if self.kernels != MXKernels.emulated:
            require(self.format == MXFormat.mxfp8 and self.elements == self.grad_elements == MXElements.e4m3
                    and self.scale_mode in (MXScaleMode.floor, MXScaleMode.rceil), "precision.options.kernels",
                    self.kernels.name, "emulated (the default) unless format=mxfp8 with e4m3 elements and gradients "
                    "and scale_mode=floor or rceil: torchao's MXFP8 training layer computes only that")
        if self.format != MXFormat.nvfp4:
            for key in ("weights_2d", "rht", "stochastic_rounding"):
                require(not getattr(self, key), f"precision.options.{key}", True,
                        f"false with format={self.format.name}: NVFP4's training recipe is nvfp4's (precision=nvfp4 "
                        "or nvfp4_recipe)")


class _MXLinear(torch.autograd.Function):
    """The three matmuls of a Linear, each operand quantized along the dimension the matmul reduces."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        fwd = layer.forward_format
        layer.observe("activation", x2, fwd)
        layer.observe("weight", weight, layer.weight_format)
        # 2D blocks: W quantized once, and its values are W^T's in the input gradient's GEMM too
        w_q = fake_quantize(weight, layer.weight_format)
        ctx.save_for_backward(x2, w_q if layer.weights_2d else weight)
        ctx.layer, ctx.has_bias, ctx.x_shape = layer, bias is not None, x.shape
        ctx.draw = layer.draws.next_key() if layer.stochastic_rounding else None  # this call's random bits
        out = fake_quantize(x2, fwd) @ w_q.t()
        if bias is not None:
            out = out + bias.float()
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x2, weight = ctx.saved_tensors
        layer = ctx.layer
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        g_fmt, fwd = layer.grad_format, layer.forward_format
        layer.observe("gradient", g2, g_fmt)
        dgrad_draw, wgrad_draw = (None, None) if ctx.draw is None else (nvfp4_recipe.draw_key(ctx.draw, 1),
                                                                         nvfp4_recipe.draw_key(ctx.draw, 2))
        w_t = weight if layer.weights_2d else fake_quantize(weight.t(), fwd).t()
        grad_x = fake_quantize(g2, g_fmt, dgrad_draw) @ w_t  # reduces over N
        g_t, x_t = g2.t(), x2.t()  # the weight gradient reduces over the tokens M
        if layer.rht is not None:  # both along M: (dY^T R)(X^T R)^T = dY^T X
            g_t, x_t = nvfp4_recipe.rht_along_columns(g_t, layer.rht), nvfp4_recipe.rht_along_columns(x_t, layer.rht)
        grad_w = fake_quantize(g_t, g_fmt, wgrad_draw) @ fake_quantize(x_t, fwd).t()
        # the bias gradient is a sum, not a matmul: from the unquantized gradient, as torchao does
        grad_b = g2.float().sum(0) if ctx.has_bias else None
        return grad_x.reshape(ctx.x_shape), grad_w, grad_b, None


def block_formats(config: MXEmulatedOptions, fmt: str) -> tuple[BlockFormat, BlockFormat]:
    """(activations and weights, gradients) of a layer computing in fmt (mxfp8, mxfp4, nvfp4)."""
    if fmt == MXFormat.nvfp4.value:
        nv = BlockFormat(ELEMENTS["e2m1"], 16, "e4m3", per_tensor_scale=config.per_tensor_scale)
        return nv, nv
    if fmt == MXFormat.mxfp4.value:
        fp4 = BlockFormat(ELEMENTS["e2m1"], 32, "e8m0", config.scale_mode)
        return fp4, fp4
    elements = config.elements.value if fmt == config.format.value else MXElements.e4m3.value
    grads = config.grad_elements.value if fmt == config.format.value else MXElements.e4m3.value
    return (BlockFormat(ELEMENTS[elements], 32, "e8m0", config.scale_mode),
            BlockFormat(ELEMENTS[grads], 32, "e8m0", config.scale_mode))


@dataclass
class Draws:
    """What NVFP4's recipe draws from, one for the model: the seed torch was seeded with when the model was built
    (train.seed), the RHT's sign vector made from it, and the training step the converter was last told of."""

    seed: int
    signs: torch.Tensor
    step: int = 0

    @classmethod
    def of(cls, seed: int) -> "Draws":
        return cls(seed, nvfp4_recipe.sign_vector(seed))

    def for_layer(self, name: str) -> "LayerDraws":
        return LayerDraws(self, nvfp4_recipe.layer_id(name))


@dataclass
class LayerDraws:
    """One layer's draws: the model's, the layer's id, and how many calls it drew for in the current step."""

    model: Draws
    layer: int
    _step: int = -1
    _calls: int = 0

    def next_key(self) -> int:
        """The key of this call's random bits: train.seed, this layer, the step and the call within the step."""
        self._calls = self._calls + 1 if self._step == self.model.step else 0
        self._step = self.model.step
        return nvfp4_recipe.draw_key(self.model.seed, self.layer, self.model.step, self._calls)


def set_numerics(gemms: Any, config: MXEmulatedOptions, fmt: str, draws: Optional[LayerDraws]) -> None:
    """What _MXLinear reads of a layer (an MXLinear, grouped experts' MXGemms): its formats, NVFP4's recipe."""
    gemms.config, gemms.fmt = config, fmt
    recipe = fmt == MXFormat.nvfp4.value  # a rule's mxfp8 or mxfp4 layer in an nvfp4 run takes none of it
    gemms.weights_2d = recipe and config.weights_2d
    gemms.stochastic_rounding = recipe and config.stochastic_rounding
    gemms.uses_rht = recipe and config.rht
    gemms.forward_format, gemms.grad_format = block_formats(config, fmt)
    gemms.weight_format = dataclasses.replace(gemms.forward_format, tiles_2d=gemms.weights_2d)
    gemms.observers = []  # ampctl inspect's, telemetry.blocks_every's: (role, matrix, format)
    gemms.draws = draws  # NVFP4's recipe: the sign vector, the stochastic rounding's keys
    gemms.rht = None  # the model's RHT matrix, set up with the weights' device


class MXGemms:
    """Grouped experts' numerics in a format: every expert's GEMMs computed as an MXLinear's (_MXLinear)."""

    def __init__(self, config: MXEmulatedOptions, fmt: str, draws: Optional[LayerDraws], device: torch.device) -> None:
        set_numerics(self, config, fmt, draws)
        if self.uses_rht:
            self.rht = nvfp4_recipe.rht_matrix(draws.model.signs).to(device)

    def observe(self, role: str, matrix: torch.Tensor, fmt: BlockFormat) -> None:
        for observer in self.observers:
            observer(role, matrix, fmt)


class MXGrouped(PerExpertLinear):
    """Mixed into grouped experts' class (engine/precision/grouped_experts.py): each expert's slice of each grouped
    matmul through _MXLinear, as an MXLinear computes its three matmuls."""

    class_prefix = "MX"
    ampctl_mx: MXGemms

    def expert_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _MXLinear.apply(x, weight, None, self.ampctl_mx)


def block_scaled_layers(model: nn.Module) -> list[tuple[str, Any]]:
    """(name, numerics) of every layer ampctl's emulation block-scales: an MXLinear is its own numerics, converted
    grouped experts have theirs (MXGemms: all their experts' GEMMs). Each has `fmt` and `observers`."""
    return [(name, module if isinstance(module, MXLinear) else module.ampctl_mx) for name, module in
            model.named_modules() if isinstance(module, (MXLinear, MXGrouped))]


class MXLinear(ConvertedLinear):
    """An nn.Linear whose three matmuls take emulated MX or NVFP4 inputs."""

    # Under autocast, inductor's CPU code generation (torch 2.14) fuses the half-to-fp32 cast of the incoming
    # gradient with its two blockings (along N and, transposed, along M) and fails in its loop split (an
    # AssertionError in try_loop_split). Such a layer runs eagerly inside a compiled model: a graph break around
    # it, the rest compiled. Made when the first layer is, not at import: `ampctl list` would import Dynamo (~2 s).
    _outside_compile: Optional[Callable[["MXLinear", torch.Tensor], torch.Tensor]] = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Any = None, *, config: MXEmulatedOptions, fmt: str,
                 draws: Optional[LayerDraws] = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        set_numerics(self, config, fmt, draws)
        if MXLinear._outside_compile is None:
            MXLinear._outside_compile = staticmethod(torch.compiler.disable(_mx_linear))

    observers: list[Callable[[str, torch.Tensor, BlockFormat], None]]
    rht: Optional[torch.Tensor]

    def setup(self) -> None:
        if self.uses_rht:
            self.rht = nvfp4_recipe.rht_matrix(self.draws.model.signs).to(self.weight.device)

    def observe(self, role: str, matrix: torch.Tensor, fmt: BlockFormat) -> None:
        """Show an operand about to be quantized to the observers (none outside an inspection)."""
        for observer in self.observers:
            observer(role, matrix, fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a rule's MX layer inside an autocast mode; a layer that draws random bits (their keys are the host's);
        # a layer observed (telemetry.blocks_every's step, an inspection): its observers are Python's
        if torch.is_autocast_enabled(x.device.type) or self.stochastic_rounding or self.observers:
            return self._outside_compile(self, x)
        return _mx_linear(self, x)

    def extra_repr(self) -> str:
        f, g = self.forward_format, self.grad_format
        scale = f"e8m0 scale_mode={f.scale_mode.value}" if f.scale == "e8m0" else (
            "e4m3 scales" + (" per_tensor_scale" if f.per_tensor_scale else ""))
        grads = f" grads={g.element.name}" if g.element != f.element else ""
        recipe = "".join(f" {key}" for key, on in (("weights_2d", self.weights_2d), ("rht", self.uses_rht),
                                                   ("stochastic_rounding", self.stochastic_rounding)) if on)
        return f"{super().extra_repr()}, {self.fmt}={f.element.name}x{f.block}{grads} {scale}{recipe}"


def _mx_linear(layer: MXLinear, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):  # the emulation's matmuls are fp32 under any mode
        return _MXLinear.apply(x, layer.weight, layer.bias, layer).to(x.dtype)



@register_converter
class MXEmulatedConverter(Converter):
    """precision=mxfp8, mxfp4, nvfp4: every nn.Linear becomes an MXLinear."""

    name = "mx_emulated"
    options_type = MXEmulatedOptions
    formats = ("mxfp8", "mxfp4", "nvfp4")

    def __init__(self, options: Any, device: torch.device) -> None:
        super().__init__(options, device)
        self.draws: Optional[Draws] = None  # made when the first layer is converted
        kernels = self.options.kernels
        real = kernels != MXKernels.emulated and mx_torchao.has_kernels(device) and mx_torchao.missing() is None
        # torchao's layers (its kernels, or where asked for, its emulated reference) or ampctl's
        self.torchao = kernels == MXKernels.torchao or (kernels == MXKernels.auto and real)
        self.real_kernels = self.torchao and real

    @property
    def emulated(self) -> bool:  # type: ignore[override]
        return not self.real_kernels

    def unsupported_reason(self) -> Optional[str]:
        return mx_torchao.missing() if self.torchao else None

    def default_format(self) -> str:
        return self.options.format.value

    def can_convert(self, module: nn.Module) -> bool:
        return type(module) is nn.Linear or is_grouped_experts(module)

    def convert(self, module: nn.Module, fqn: str, fmt: str) -> nn.Module:
        # a rule's other format, or dimensions not in whole blocks: ampctl's emulation (the layer table says which)
        if self.torchao and fmt == MXFormat.mxfp8.value and type(module) is nn.Linear and mx_torchao.fits(module):
            return mx_torchao.convert(module, self.real_kernels, self.options.scale_mode.value)
        if self.draws is None:  # the model is built: torch was seeded with train.seed
            self.draws = Draws.of(torch.initial_seed())
        if is_grouped_experts(module):
            device = next(module.parameters()).device
            module.ampctl_mx = MXGemms(self.options, fmt, self.draws.for_layer(fqn), device)
            return mix_into(module, MXGrouped)
        return MXLinear.from_linear(module, config=self.options, fmt=fmt, draws=self.draws.for_layer(fqn))

    def at_step(self, step: int) -> None:
        if self.draws is not None:
            self.draws.step = step

    def describe(self) -> str:
        o = self.options
        forward, grads = block_formats(o, o.format.value)
        by = ("torchao's kernels" if self.real_kernels else "torchao's emulated reference" if self.torchao
              else "emulated")
        text = f"{o.format.value}={by} elements={forward.element.name} block={forward.block}"
        if o.format == MXFormat.mxfp8:
            text += f" grad_elements={grads.element.name}"
        if forward.scale == "e8m0":
            return f"{text} scales=e8m0 scale_mode={o.scale_mode.value}"
        recipe = [key for key in ("weights_2d", "rht", "stochastic_rounding") if getattr(o, key)]
        if o.rht and self.draws is not None:
            recipe[recipe.index("rht")] = "rht signs=" + "".join("+" if s > 0 else "-" for s in self.draws.signs)
        return f"{text} scales=e4m3 per_tensor_scale={o.per_tensor_scale}" + "".join(f" {r}" for r in recipe)

    def speed_warnings(self, compiled: bool) -> list[str]:
        if self.real_kernels:
            return []
        return [f"emulates {self.options.format.value} (quantize and dequantize around fp32 matmuls): slower than "
                "fp32 by design, and its speed is not the format's; it is for studying the format's convergence "
                "and error"]
