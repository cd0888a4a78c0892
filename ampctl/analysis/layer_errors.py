"""Where a precision mode loses accuracy, layer by layer (`ampctl diff`): the same weights and the same batches
through a reference (fp32 by default) and a candidate mode, and for every leaf layer the error of
- its output (forward), of the gradient it passes back to its input (dgrad) and of its weight gradient (wgrad):
  relative RMS error (||candidate - reference|| / ||reference||), the output's cosine similarity and largest
  absolute error, and the share of its output the candidate's type flushed to zero or saturated;
- local: the layer run in the candidate's precision on the reference's own input and output gradient, against the
  reference's own result: the error it adds itself (its input rounded into the type it takes, and whatever its
  computation makes of that: a sum that cancels, a range its format cannot hold); total: what the candidate
  computed end to end, its own error and what it inherited; and the inherited error itself, of the input and of
  the gradient that reach the layer. One bad layer is blamed once, not in every layer after it;
and for the whole model, the error of the loss and of the whole gradient against the gradient's own
batch-to-batch noise at these weights: a precision error far below the noise SGD already lives with does not
change training, one near it can (the yardstick).

The candidate's backward runs under the loss scale its training would start with (fp16's GradScaler scale), its
gradients divided by it before they are compared, so that what the scale saves from underflow is not counted as
lost. Dropout is off in both (a diff compares computation, not random masks); every buffer a forward updates
(BatchNorm's running statistics, FP8's amax histories) is restored after each layer's re-run. Error that no leaf
adds (a functional op between layers: attention's softmax, a residual add) shows as the inherited error of the
next layer growing past what the layers before it added. Every sum is kept in float64.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from ampctl.analysis.error_sums import ErrorSums
from ampctl.analysis.routing import RoutingWatch
from ampctl.engine.precision.grouped_experts import is_grouped_experts

QUANTITIES = ("out", "dgrad", "wgrad")  # a layer's output, the gradient to its input, its weight gradient
_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


@dataclass
class LayerErrors:
    """One leaf layer's sums: local and total per quantity, and what it inherited."""

    name: str
    kind: str  # its class name
    local: dict[str, ErrorSums] = field(default_factory=lambda: {q: ErrorSums() for q in QUANTITIES})
    total: dict[str, ErrorSums] = field(default_factory=lambda: {q: ErrorSums() for q in QUANTITIES})
    inherited_input: ErrorSums = field(default_factory=ErrorSums)
    inherited_grad: ErrorSums = field(default_factory=ErrorSums)  # of the gradient reaching its output
    # grouped experts (a mixture of experts): each expert's local output error, its rows on the reference's routing
    per_expert: list[ErrorSums] = field(default_factory=list)

    def local_error(self) -> float:
        """What ranks it: the largest local relative error of its output, dgrad and wgrad."""
        return max((s.rel_rms for s in self.local.values() if s.values), default=0.0)


@dataclass
class ModelErrors:
    """The whole model's: the loss's and the gradient's error, and the gradient's batch-to-batch noise."""

    losses: list[tuple[float, float]] = field(default_factory=list)  # (reference, candidate) per batch
    gradient: ErrorSums = field(default_factory=ErrorSums)
    grad_sq: list[float] = field(default_factory=list)  # ||g_b||^2 of the reference, per batch
    grad_sum: Optional[list[torch.Tensor]] = None  # sum over batches of the reference's gradient, per parameter
    by_param: dict[str, float] = field(default_factory=dict)  # each parameter's squared error, over the batches
    by_layer: dict[str, float] = field(default_factory=dict)  # each layer's share of the gradient's squared error
    backoffs: int = 0  # the candidate's loss scale halved on a non-finite gradient, as GradScaler would

    def noise(self) -> Optional[float]:
        """The reference gradient's batch-to-batch spread, relative: sqrt(mean ||g_b - mean g||^2) (unbiased) over
        sqrt(mean ||g_b||^2). None with fewer than two batches."""
        n = len(self.grad_sq)
        if n < 2 or self.grad_sum is None:
            return None
        mean_sq = sum(float(s.double().pow(2).sum()) for s in self.grad_sum) / n ** 2
        spread = max(sum(self.grad_sq) / n - mean_sq, 0.0) * n / (n - 1)
        return math.sqrt(spread / (sum(self.grad_sq) / n)) if sum(self.grad_sq) else None

    def loss_error(self) -> float:
        """The mean absolute difference of the candidate's loss from the reference's, batch by batch."""
        return sum(abs(c - r) for r, c in self.losses) / len(self.losses) if self.losses else 0.0

    def loss_noise(self) -> Optional[float]:
        """The standard deviation of the reference's loss from batch to batch."""
        refs = [r for r, _ in self.losses]
        if len(refs) < 2:
            return None
        mean = sum(refs) / len(refs)
        return math.sqrt(sum((r - mean) ** 2 for r in refs) / (len(refs) - 1))


@dataclass
class Side:
    """One precision's model: the mode's policy (entered around its computations), its forward context (autocast)
    and the loss scale its backward runs under."""

    model: nn.Module
    enter: Callable[[], Any]  # the policy as a context manager (its matmul flags)
    forward_context: Callable[[], Any]  # its autocast
    scale: float = 1.0


@dataclass
class _Seen:
    """What a layer saw in one forward and backward: its call's arguments (the input at index `at`), output, the
    gradient that reached the output and the one it passed back to its input (its own: its input was a copy only it
    took), and how many times it was called."""

    args: tuple
    kwargs: dict
    at: int
    output: torch.Tensor
    grad: Optional[torch.Tensor] = None
    dgrad: Optional[torch.Tensor] = None
    calls: int = 1


class _Capture:
    """Hooks on the named layers: each call's arguments and output, cloned (a later in-place op must not change
    them), the gradient reaching the output and the one the layer passes back to its input. The input is handed to
    the layer as a copy of its own (a residual stream's other uses do not add to its gradient), where it requires
    one (the graph is the model's own); the output to the next layers as a clone (an in-place op
    after it, ReLU(inplace=True), modifies the clone and the gradient hook sees the layer's own)."""

    def __init__(self, model: nn.Module, names: Iterable[str]) -> None:
        self.model, self.names = model, list(names)
        self.seen: dict[str, _Seen] = {}
        self._inputs: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> "_Capture":
        for name in self.names:
            module = self.model.get_submodule(name)
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, name: str) -> Callable:
        def pre_hook(_module: nn.Module, args: tuple, kwargs: dict) -> Any:
            at = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
            if at is None or not args[at].requires_grad:  # the data (the first layer's): re-run for its dgrad
                return None
            own = args[at].clone()
            self._inputs[name] = own
            return (*args[:at], own, *args[at + 1:]), kwargs

        return pre_hook

    def _hook(self, name: str) -> Callable:
        def hook(_module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            at = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
            if at is None or not isinstance(output, torch.Tensor):
                return None  # no tensor in, or not one tensor out: not compared
            earlier = self.seen.get(name)
            seen = _Seen(tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args),
                         dict(kwargs), at, output.detach().clone(), calls=earlier.calls + 1 if earlier else 1)
            self.seen[name] = seen
            own_input = self._inputs.pop(name, None)
            if own_input is not None and own_input.requires_grad:
                def keep_dgrad(grad: torch.Tensor) -> None:
                    seen.dgrad = grad.detach().clone()

                own_input.register_hook(keep_dgrad)
            if not output.requires_grad:
                return None

            def keep(grad: torch.Tensor) -> None:
                seen.grad = grad.detach().clone()

            output.register_hook(keep)
            return output.clone()

        return hook


def leaf_layers(model: nn.Module) -> dict[str, str]:
    """The model's leaf modules, by name: their class names."""
    return {name: type(m).__name__ for name, m in model.named_modules() if name and not list(m.children())}


def quiet_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, _DROPOUT):
            module.eval()


def measure(reference: Side, candidate: Side, loss: Callable[[nn.Module, Any], torch.Tensor],
            batches: Iterable[Any], on_batch: Callable[[int], None] = lambda done: None,
            per_layer: bool = True, on_layer: Callable[[int, int, int], None] = lambda batch, done, of: None,
            routing: Optional[RoutingWatch] = None) -> tuple[dict[str, LayerErrors], ModelErrors]:
    """Every batch through both sides; the sums of every leaf layer of the reference that the candidate has by the
    same name (per_layer=False: none, only the whole model's: two forwards and backwards a batch), and the whole
    model's. on_layer(batch, layers done, layers): after each layer's comparison; on_batch(batch): after each
    batch's; routing: its routers watched through both passes and compared (analysis/routing.py)."""

    def watched(key: str, side: Side) -> Any:
        return routing.capturing(key, side.model) if routing is not None else contextlib.nullcontext()

    kinds = leaf_layers(reference.model)
    cand_modules = dict(candidate.model.named_modules())
    names = [n for n in kinds if n in cand_modules] if per_layer else []
    layers = {n: LayerErrors(n, type(cand_modules[n]).__name__) for n in names}
    model = ModelErrors()
    for side in (reference, candidate):
        side.model.train()
        quiet_dropout(side.model)
    shared = {id(reference.model): _shared_parameters(reference.model),
              id(candidate.model): _shared_parameters(candidate.model)}
    for done, batch in enumerate(batches, start=1):
        ref_seen, ref_loss, ref_grads = _forward_backward(reference, loss, batch, names, watched("reference",
                                                                                                reference))
        cand_seen, cand_loss, cand_grads = _forward_backward(candidate, loss, batch, names, watched("candidate",
                                                                                                 candidate))
        while candidate.scale > 1 and not all(bool(torch.isfinite(g).all()) for g in cand_grads.values()):
            # a scaled backward that overflows: its training would skip the step and halve the scale (GradScaler's
            # backoff), until the gradient is finite; the scale it ends at is the one compared under
            candidate.scale /= 2
            model.backoffs += 1
            cand_seen, cand_loss, cand_grads = _forward_backward(candidate, loss, batch, names)
        if routing is not None:
            routing.compare(candidate.model, candidate.enter, candidate.forward_context)
        model.losses.append((ref_loss, cand_loss))
        _add_gradients(model, ref_grads, cand_grads, candidate.scale)
        for index, name in enumerate(names, start=1):
            if name in ref_seen and name in cand_seen:
                ref = _Pass(reference, ref_seen[name], ref_grads, shared[id(reference.model)])
                cand = _Pass(candidate, cand_seen[name], cand_grads, shared[id(candidate.model)])
                _compare_layer(layers[name], ref, cand)
            on_layer(done, index, len(names))
        on_batch(done)
    _attribute(model, layers, reference.model)
    return layers, model


def _forward_backward(side: Side, loss: Callable, batch: Any, names: list[str],
                      around: Any = None) -> tuple[dict[str, _Seen], float, dict[str, torch.Tensor]]:
    side.model.zero_grad(set_to_none=True)
    with side.enter(), _Capture(side.model, names) as capture, around or contextlib.nullcontext():
        with side.forward_context():
            value = loss(side.model, batch)
        (value * side.scale).backward()
    grads = {n: p.grad.detach().double() / side.scale if side.scale != 1 else p.grad.detach().double()
             for n, p in side.model.named_parameters() if p.grad is not None}
    side.model.zero_grad(set_to_none=True)
    return capture.seen, float(value.detach()), grads


def _add_gradients(model: ModelErrors, ref: dict[str, torch.Tensor], cand: dict[str, torch.Tensor],
                   scale: float) -> None:
    shared = [n for n in ref if n in cand and ref[n].shape == cand[n].shape]
    for n in shared:
        model.gradient.add(cand[n], ref[n])
        err = float((cand[n] - ref[n]).pow(2).nan_to_num(math.inf).sum())
        model.by_param[n] = model.by_param.get(n, 0.0) + err
    model.grad_sq.append(sum(float(ref[n].pow(2).sum()) for n in shared))
    flat = [ref[n].float() for n in shared]
    model.grad_sum = flat if model.grad_sum is None else [s + g for s, g in zip(model.grad_sum, flat)]


@dataclass
class _Pass:
    """One side's full forward and backward, as one layer saw it."""

    side: Side
    seen: _Seen
    grads: dict[str, torch.Tensor]  # every parameter's gradient, float64, unscaled
    shared: set[int]  # the ids of the parameters more than one module holds (a tied embedding)


def _shared_parameters(model: nn.Module) -> set[int]:
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    return {key for key, count in owners.items() if count > 1}


# a layer's output, dgrad and wgrad (the gradients float64 and unscaled; None where there is none)
Results = tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]


def _as_computed(name: str, run: _Pass) -> Optional[Results]:
    """The layer's (output, dgrad, wgrad) as the full forward and backward computed them, where they are its alone:
    called once, and no parameter of its held by another module (a tied weight's gradient is both users'). None
    where they are not (the layer is run again on what it saw). The full pass is the same computation on the same
    values as a re-run: measuring each layer's end-to-end results once (a diff batch cost 16 training steps)."""
    module = run.side.model.get_submodule(name)
    params = [(pname, p) for pname, p in module.named_parameters() if p.requires_grad]
    if run.seen.calls != 1 or any(id(p) in run.shared for _, p in params):
        return None
    x = run.seen.args[run.seen.at]
    if x.is_floating_point() and run.seen.dgrad is None:  # its input's gradient did not come back: re-run it
        return None
    dgrad = run.seen.dgrad.double() / run.side.scale if run.seen.dgrad is not None else None
    weight = [run.grads[f"{name}.{pname}"].flatten() for pname, _ in params if f"{name}.{pname}" in run.grads]
    return run.seen.output, dgrad, (torch.cat(weight) if weight else None)


def _compare_layer(errors: LayerErrors, ref: _Pass, cand: _Pass) -> None:
    """The reference's layer as it computed (its own output, dgrad and wgrad); the candidate's end to end, and
    locally: re-run on the reference's input and output gradient, held in the types the candidate's layer takes
    them in, so that the rounding into them and every error the layer makes of it (a sum that cancels, a range its
    format cannot hold) are its own."""
    reference, candidate = ref.side, cand.side
    ref_module = reference.model.get_submodule(errors.name)
    cand_module = candidate.model.get_submodule(errors.name)
    r, c = ref.seen, cand.seen
    # grouped experts' rows are in each side's own routing order: compared end to end only where the routing agrees
    # (a token sent elsewhere misaligns every row after it; analysis/routing.py counts those)
    aligned = not is_grouped_experts(cand_module) or torch.equal(r.args[1], c.args[1])
    if aligned:
        errors.inherited_input.add(c.args[c.at], r.args[r.at])
        errors.total["out"].add(c.output, r.output)
    # locally, its other arguments that are not values are the reference's: grouped experts' counts, the groups
    # the reference's routing made of the rows it is given
    mine = dataclasses.replace(c, args=tuple(b if isinstance(b, torch.Tensor) and not b.is_floating_point() else a
                                             for a, b in zip(c.args, r.args)))
    if r.grad is None or c.grad is None:  # no gradient reaches it (a frozen first layer): its output alone
        local = _layer_vjp(candidate, cand_module, mine, r.args[r.at].to(c.args[c.at].dtype), None)
        errors.local["out"].add(local[0], r.output)
        return
    errors.inherited_grad.add(c.grad.double() / candidate.scale, r.grad.double() / reference.scale)
    exact = _as_computed(errors.name, ref) or _layer_vjp(reference, ref_module, r, r.args[r.at], r.grad)
    total = _as_computed(errors.name, cand) or _layer_vjp(candidate, cand_module, c, c.args[c.at], c.grad)
    upstream = (r.grad.double() * (candidate.scale / reference.scale)).to(c.grad.dtype)
    local = _layer_vjp(candidate, cand_module, mine, r.args[r.at].to(c.args[c.at].dtype), upstream)
    if is_grouped_experts(cand_module) and exact[0] is not None:
        _per_expert(errors, local[0], exact[0], r.args[1])
    for index, quantity in enumerate(QUANTITIES):
        if exact[index] is None:
            continue
        if local[index] is not None:
            errors.local[quantity].add(local[index], exact[index])
        if quantity != "out" and total[index] is not None and (aligned or quantity == "wgrad"):
            errors.total[quantity].add(total[index], exact[index])


def _per_expert(errors: LayerErrors, local: torch.Tensor, exact: torch.Tensor, counts: torch.Tensor) -> None:
    """Grouped experts' local output, expert by expert: its rows are sorted by expert, counts[e] of them e's."""
    sizes = counts.tolist()
    if not errors.per_expert:
        errors.per_expert = [ErrorSums() for _ in sizes]
    for sums, cand, ref in zip(errors.per_expert, torch.split(local, sizes), torch.split(exact, sizes)):
        if ref.numel():
            sums.add(cand, ref)


def _layer_vjp(side: Side, module: nn.Module, seen: _Seen, x: torch.Tensor, upstream: Optional[torch.Tensor]
               ) -> Results:
    """The layer's output for input x, and the gradients to x and to its weights for the gradient `upstream` at its
    output (scaled, as this side's backward has it), computed as this side computes (its matmul flags, its
    autocast): (output, dgrad, wgrad), the gradients in float64, unscaled, None where there is none (no upstream:
    the output only)."""
    x = x.detach().requires_grad_(x.is_floating_point())
    args = list(seen.args)
    args[seen.at] = x
    params = [p for p in module.parameters() if p.requires_grad]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with side.enter():
            with side.forward_context():
                out = module(*args, **seen.kwargs)
            wanted = [*([x] if x.requires_grad else []), *params]
            grads = torch.autograd.grad(out, wanted, grad_outputs=upstream.to(out.dtype), allow_unused=True) if (
                wanted and out.requires_grad and upstream is not None) else [None] * len(wanted)
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    dgrad = grads[0].double() / side.scale if x.requires_grad and grads[0] is not None else None
    weight = [g.double().flatten() / side.scale for g in grads[1 if x.requires_grad else 0:] if g is not None]
    return out.detach(), dgrad, (torch.cat(weight) if weight else None)


def _attribute(model: ModelErrors, layers: dict[str, LayerErrors], reference: nn.Module) -> None:
    """Each leaf layer's share of the whole gradient's squared error (its own parameters'), by parameter name; where
    the error is not finite, the layers whose gradients are not share it."""
    total = sum(model.by_param.values())
    if math.isinf(total):
        model.by_param = {param: 1.0 if math.isinf(err) else 0.0 for param, err in model.by_param.items()}
        total = sum(model.by_param.values())
    owners = {f"{name}.{p}": name for name in layers for p, _ in reference.get_submodule(name).named_parameters()}
    for param, err in model.by_param.items():
        owner = owners.get(param)
        if owner is not None and total > 0:
            model.by_layer[owner] = model.by_layer.get(owner, 0.0) + err / total
