"""The recipe protocol: what a workload gives the loop. Built-ins live in recipes/; a user's recipe is any
importable callable named by `_target_` in a recipe YAML that returns an object with these members."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
import typing
from typing import Any, Iterator, Optional, Protocol, runtime_checkable

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig
from torch import nn

from ampctl.conf.messages import did_you_mean, instantiation_error
from ampctl.errors import ConfigError, UsageError
from ampctl.recipes.libraries import torchvision_mismatch, torchvision_mismatch_in


@runtime_checkable
class Recipe(Protocol):
    """A model, an endless stream of batches, and a loss.

    The loop calls ``build_model()`` once (after seeding torch), ``batches(device, seed)`` once, then
    ``loss(model, batch)`` per micro-batch under the precision policy's autocast context. Throughput is
    ``samples_per_batch`` (and ``tokens_per_batch`` for language models) per micro-batch; they are plain
    numbers so that counting them never reads from the device.

    Optional, for a resume: ``batches_from(device, seed, position)``, the stream of ``batches(device, seed)`` from
    its position-th batch on, without producing those before it (a DataLoader recipe then reads no sample twice
    at a resume; without it the loop draws and discards the batches before the position). Used only where the
    class that defines it defines ``batches`` too, or inherits it (starts_anywhere).

    Optional, for train.eval.every (engine/evaluation.py): ``eval_batches(device)``, held-out batches, the same
    on every call and for every seed; ``eval_metrics(model, batch)``, each metric summed over the batch and
    ``count``, how many it summed over (without it the held-out metric is ``loss``, a batch counting one).
    """

    samples_per_batch: int
    tokens_per_batch: Optional[int]

    def build_model(self) -> nn.Module: ...

    def batches(self, device: torch.device, seed: int) -> Iterator[Any]: ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...


def build_recipe(cfg: DictConfig) -> Recipe:
    """Instantiate the recipe named by cfg._target_ and check it follows the protocol."""
    target = cfg.get("_target_")
    check_field_names(cfg, target)
    check_field_types(cfg, target)
    try:
        recipe = instantiate(cfg)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, UsageError):
            raise cause from None
        if torchvision_mismatch_in(exc):  # a model library imported torchvision as the recipe was made
            raise UsageError(f"recipe._target_={target!r}: {torchvision_mismatch()}") from None
        reason = instantiation_error(exc)
        while cause is not None and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, ImportError):
            reason += " (is its module importable? run from the directory that holds it with PYTHONPATH=.)"
        raise UsageError(f"recipe._target_={target!r} could not be instantiated: {reason}") from None
    missing = [name for name in ("samples_per_batch", "tokens_per_batch", "build_model", "batches", "loss")
               if not hasattr(recipe, name)]
    if missing:
        raise UsageError(
            f"recipe._target_={target!r} returned a {type(recipe).__name__} without {', '.join(missing)}; "
            "a recipe needs samples_per_batch, tokens_per_batch, build_model(), batches(device, seed) "
            "and loss(model, batch) (see docs/models.md, 'Add your own recipe')"
        )
    for name, optional in (("samples_per_batch", False), ("tokens_per_batch", True)):
        value = getattr(recipe, name)
        if not (optional and value is None) and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UsageError(f"recipe._target_={target!r}: {name} is {_what(value)}; the protocol needs an integer "
                             f">= 1 (the {name.split('_')[0]} in one batch)" + (", or None" if optional else ""))
    return recipe


def starts_anywhere(recipe: Any) -> bool:
    """Whether recipe.batches_from gives recipe.batches' stream from a position: a subclass that changes batches
    alone (a delay, a filter) inherits a batches_from that would skip its change, and is replayed instead."""
    if "batches_from" in vars(recipe):  # set per instance (a rank's view of a recipe that starts anywhere)
        return True

    def owner(name: str) -> Optional[type]:
        return next((cls for cls in type(recipe).__mro__ if name in vars(cls)), None)

    start, plain = owner("batches_from"), owner("batches")
    return start is not None and plain is not None and issubclass(start, plain)


def checked_batches(batches: Any, recipe: Recipe) -> Iterator[Any]:
    """batches(device, seed)'s result as an iterator (a list is one too: it ends, which the loop says when)."""
    try:
        return iter(batches)
    except TypeError:
        raise UsageError(f"recipe {recipe_name(recipe)}: batches(device, seed) returned {_what(batches)}; the protocol "
                         "needs an endless iterator of batches (a generator that yields them)") from None


def checked_blocks(blocks: Any, recipe: Recipe) -> list[nn.Module]:
    """activation_checkpoint_blocks(model)'s result as a list of modules."""
    try:
        found = list(blocks)
    except TypeError:
        found = None
    if found is None or not all(isinstance(block, nn.Module) for block in found):
        raise UsageError(f"recipe {recipe_name(recipe)}: activation_checkpoint_blocks(model) returned {_what(blocks)}; "
                         "the protocol needs a list of the model's torch.nn.Module blocks")
    return found


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def check_field_names(cfg: DictConfig, target: Any) -> None:
    """Every key of the recipe's config one its callable takes (a dataclass's fields, a function's arguments,
    unless it takes **kwargs): a typo in a recipe YAML of one's own (`hiden: 32`) is one line with the closest name,
    not the constructor's TypeError."""
    try:
        taken = list(inspect.signature(get_object(str(target))).parameters.values())
    except Exception:  # noqa: BLE001 - an unimportable target is reported by its instantiation
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken):
        return
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [p.name for p in taken if p.kind in by_name]
    for key in cfg:
        if not str(key).startswith("_") and key not in names:
            raise UsageError(f"recipe.{key}: {str(target).rsplit('.', 1)[-1]} takes no such option"
                             f"{did_you_mean(str(key), names, 'recipe.')}; it takes {', '.join(names)}")


def check_field_types(cfg: DictConfig, target: Any) -> None:
    """A dataclass recipe's values against its fields' plain types (int, float, str, bool, Optional of them):
    `recipe.hidden=2.5` is refused naming the key, instead of failing deep inside torch. Other annotations,
    and recipes that are not dataclasses, are the recipe's own to check."""
    try:
        cls = get_object(str(target))
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    except Exception:  # noqa: BLE001 - an unimportable target is reported by its instantiation
        return
    for name, hint in hints.items():
        if name not in cfg:
            continue
        value, args = cfg[name], typing.get_args(hint)
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
        kind = next((a for a in args if a is not type(None)), None) if optional and len(args) == 2 else hint
        if kind not in _KINDS or (value is None and optional):
            continue
        fits = isinstance(value, kind) and not (kind is int and isinstance(value, bool)) or \
            (kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not fits:
            raise ConfigError(f"recipe.{name}", value, _KINDS[kind] + (" or null" if optional else ""))


def recipe_name(recipe: Any) -> str:
    cls = type(getattr(recipe, "_recipe", recipe))  # the recipe itself, not a rank's view of it
    return f"{cls.__module__}.{cls.__qualname__}"


@contextlib.contextmanager
def building_model(recipe: Recipe) -> Iterator[None]:
    """Around recipe.build_model(): a model whose tensors cannot exist at all (a size option far too large: the
    storage size overflows, or the allocator refuses it) is the recipe's config, said in one line naming its
    largest size option."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not (isinstance(exc, torch.OutOfMemoryError) or "Storage size calculation overflowed" in text
                or "can't allocate memory" in text):
            raise
        sizes = sorted(((value, key) for key, value in vars(getattr(recipe, "_recipe", recipe)).items()
                        if isinstance(value, int) and not isinstance(value, bool) and not key.startswith("_")
                        and key not in ("samples_per_batch", "tokens_per_batch")), reverse=True)
        largest = f"; its largest size option: recipe.{sizes[0][1]}={sizes[0][0]}" if sizes else ""
        raise UsageError(f"recipe {recipe_name(recipe)}: its model cannot be built, its tensors are too large to "
                         f"allocate ({text}){largest}") from None


def checked_model(model: Any, recipe: Recipe) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise UsageError(f"recipe {recipe_name(recipe)}: build_model() returned {_what(model)}; the protocol needs a "
                         "torch.nn.Module")
    return model


def checked_loss(loss: Any, recipe: Recipe) -> torch.Tensor:
    """loss(model, batch)'s result as the step needs it: a 0-dim floating tensor attached to the graph. Only
    host-side metadata is read (type, shape, dtype, requires_grad): no device sync."""
    if isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point() and loss.requires_grad:
        return loss
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        need = "a scalar (0-dim) floating-point tensor" + (": reduce it, e.g. .mean()"
                                                           if isinstance(loss, torch.Tensor) and loss.ndim else "")
    else:
        need = "a loss computed from the model's output (this one has no grad: under torch.no_grad, or detached?)"
    raise UsageError(f"recipe {recipe_name(recipe)}: loss(model, batch) returned {_what(loss)}; the protocol "
                     f"needs {need}")


def _what(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        grad = "" if value.requires_grad else " without grad"
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}{grad}"
    if value is None:
        return "None"
    name = type(value).__name__
    shown = f" ({value!r})" if isinstance(value, (int, float, str)) and len(repr(value)) <= 40 else ""
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}{shown}"


def require_positive(recipe: Any, *keys: str) -> None:
    """Each of the recipe's keys an integer >= 1 (sizes, counts), or a ConfigError naming the first that is not."""
    for key in keys:
        if getattr(recipe, key) < 1:
            raise ConfigError(f"recipe.{key}", getattr(recipe, key), "an integer >= 1")


def plain_dict(node: Any) -> dict:
    """A mapping argument as Hydra's instantiate passes it (a DictConfig, lists inside as ListConfig) as the
    plain dict a library's constructor expects."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


# The keys by which a recipe config names the model it trains (timm's model, transformers' model_type)
MODEL_KEYS = ("model", "model_type")


def recipe_title(choice: str, recipe_cfg: Any) -> str:
    """The recipe as the start line and plot titles show it: the user's choice, and the model it names
    (`timm (vit_tiny_patch16_224)`, `hf_causal_lm (llama)`)."""
    model = next((recipe_cfg.get(key) for key in MODEL_KEYS
                  if isinstance(recipe_cfg, (dict, DictConfig)) and isinstance(recipe_cfg.get(key), str)), None)
    return f"{choice} ({model})" if model else choice
