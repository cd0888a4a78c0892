"""`ampctl init NAME [--from RECIPE] [--dir DIR]`: an editable experiment of your own, in the spirit of
torchtune's `tune cp`: NAME.yaml (an experiment config over ampctl's train config), recipe/NAME.yaml (its
recipe's config) and NAME_recipe.py (the recipe: model, batches, loss), which `ampctl train -cd DIR -cn NAME`
runs as written. Without --from the recipe is a small skeleton to fill in; with --from it is a copy of a
built-in recipe (gpt, timm, hf_causal_lm, ...): its module's source and its config as ampctl composes it,
under the new name, to change (the model, the data). Nothing is overwritten: a file that exists already is
refused before anything is written."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Optional

from ampctl.errors import OneLineArgumentParser, UsageError, cannot_write, write_refused
from ampctl.shell.command import Command, Section

EXPERIMENT = """\
# {name}: an ampctl experiment. Run it: ampctl train -cd {dir} -cn {name}
# (any override still applies: ampctl train -cd {dir} -cn {name} precision=fp16 train.steps=500;
#  a sweep: ampctl train -cd {dir} -cn {name} -m precision=fp32,bf16). `ampctl list -cd {dir}` lists it.
defaults:
  - train                   # ampctl's own train config: every default, the checks, the live view
  - override recipe: {name}  # recipe/{name}.yaml, beside this file
  - override precision: fp32  # fp16, bf16, O2, fp8, ...: `ampctl list` says what runs (fast) here
  - _self_

train:
  steps: 200
  log_every: 10
optimizer:
  lr: 1.0e-3
"""

RECIPE_CONFIG = """\
# {name}: my recipe ({name}_recipe.py beside the experiment config; the -cd directory is importable).
_target_: {name}_recipe.Recipe
features: 64
hidden: 256
batch_size: 128
"""

RECIPE_SOURCE = '''\
"""The {name} recipe: what ampctl trains. Edit freely; the protocol is five members (docs/models.md: "Add your
own recipe"): samples_per_batch, tokens_per_batch, build_model(), batches(device, seed), loss(model, batch); and,
for train.eval.every, eval_batches(device) and (optional) eval_metrics(model, batch)."""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

TEACHER_SEED = 1234  # every run learns the same function; train.seed chooses the inputs
HELD_OUT_SEED = 987654321  # the held-out inputs: the same for every run, never a training seed


class Recipe:
    """Regression onto a fixed random teacher network: a task that learns in seconds on a CPU."""

    def __init__(self, features: int = 64, hidden: int = 256, batch_size: int = 128) -> None:
        self.features, self.hidden = features, hidden
        self.samples_per_batch = batch_size  # for samples/s
        self.tokens_per_batch = None  # a language model returns its tokens per batch (for tokens/s)

    def build_model(self) -> nn.Module:
        """Called once, after torch.manual_seed(train.seed); ampctl moves and casts it for the precision mode."""
        return nn.Sequential(nn.Linear(self.features, self.hidden), nn.GELU(), nn.LayerNorm(self.hidden),
                             nn.Linear(self.hidden, 1))

    def batches(self, device: torch.device, seed: int) -> Iterator[Any]:
        """An endless stream of batches already on `device`, the same for the same seed (resume depends on it)."""
        return self._labelled(device, seed)

    def eval_batches(self, device: torch.device) -> Iterator[Any]:
        """Held-out batches (train.eval.every), the same on every call and for every seed: every run is measured
        on the same data. ampctl takes the first train.eval.batches of them."""
        return self._labelled(device, HELD_OUT_SEED)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """A scalar, computed under the precision mode's autocast (the loss itself in fp32)."""
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    def eval_metrics(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Optional: each metric summed over the batch's examples, and `count`, how many (ampctl divides the sums
        over all held-out batches by the counts). Without it the held-out metric is loss(), a batch counting one."""
        x, y = batch
        squared_error = (model(x).float() - y) ** 2
        return {{"loss": squared_error.sum(), "count": torch.tensor(float(y.numel()), device=y.device)}}

    def _labelled(self, device: torch.device, seed: int) -> Iterator[Any]:
        teacher = torch.randn(self.features, 1, device=device,
                              generator=torch.Generator(device=device).manual_seed(TEACHER_SEED)) / self.features**0.5
        gen = torch.Generator(device=device).manual_seed(seed)
        while True:
            x = torch.randn(self.samples_per_batch, self.features, generator=gen, device=device)
            yield x, torch.tanh(x @ teacher)
'''

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def files(name: str, directory: Path, source: Optional[str] = None) -> dict[Path, str]:
    shown = str(directory)
    recipe_config, recipe_source = (RECIPE_CONFIG.format(name=name), RECIPE_SOURCE.format(name=name)) \
        if source is None else copied_recipe(name, source)
    return {
        directory / f"{name}.yaml": EXPERIMENT.format(name=name, dir=shown),
        directory / "recipe" / f"{name}.yaml": recipe_config,
        directory / f"{name}_recipe.py": recipe_source,
    }


def built_in_recipes() -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in resources.files("ampctl.conf").joinpath("recipe").iterdir()
                  if p.name.endswith(".yaml"))


def copied_recipe(name: str, source: str) -> tuple[str, str]:
    """recipe/NAME.yaml and NAME_recipe.py for a copy of the built-in recipe `source`: its config as ampctl composes
    it (a variant such as gpt2 with its base's keys), its _target_ the copy's class; its module's source as it is
    (it imports ampctl's helpers: the text corpus, the library imports), read without importing it."""
    from omegaconf import OmegaConf

    from ampctl.shell.hydra_internals import composed

    with composed("train", [f"recipe={source}"]) as cfg:
        recipe = OmegaConf.to_container(cfg.recipe, resolve=False)
    module, _, cls = recipe["_target_"].rpartition(".")
    origin = importlib.util.find_spec(module).origin
    recipe["_target_"] = f"{name}_recipe.{cls}"
    comments = [line for line in _leading_comments(source)]
    config = "\n".join([f"# {name}: a copy of ampctl's recipe={source} ({cls} in {name}_recipe.py, beside the "
                         "experiment config), to edit.", *comments, OmegaConf.to_yaml(recipe)])
    code = (f"# {name}_recipe.py: a copy of {module} (ampctl's recipe={source}), written by `ampctl init {name} "
            f"--from {source}`. Edit freely:\n# ampctl runs it as recipe={name}; its FLOPs are counted by "
            "torch.utils.flop_counter, since the model may now differ.\n" + Path(origin).read_text(encoding="utf-8"))
    return config, code


def _leading_comments(recipe: str) -> list[str]:
    text = resources.files("ampctl.conf").joinpath("recipe", f"{recipe}.yaml").read_text(encoding="utf-8")
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def arguments() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="ampctl init", description="Write an editable experiment config and recipe "
                           "skeleton that `ampctl train -cd DIR -cn NAME` runs as written.",
                           epilog="example: ampctl init my_exp && ampctl train -cd . -cn my_exp")
    parser.add_argument("name", metavar="NAME", help="the experiment's name (a Python identifier: it names a module)")
    source = parser.add_argument("--from", dest="source", metavar="RECIPE",
                                 help="copy a built-in recipe (its source and config) instead of the skeleton: "
                                      + ", ".join(built_in_recipes()))
    source.completer = lambda current: built_in_recipes()  # checked in main, with a did-you-mean
    parser.add_argument("--dir", type=Path, default=Path("."), metavar="DIR",
                        help="where to write the files (default: the current directory)")
    return parser


def main() -> None:
    parser = arguments()
    args = parser.parse_args(sys.argv[1:])
    if not NAME.fullmatch(args.name):
        parser.error(f"NAME={args.name!r} is not allowed: a Python identifier (letters, digits, _; not starting "
                     "with a digit), since it names the recipe's module")
    if args.source is not None and args.source not in built_in_recipes():
        from ampctl.conf.messages import did_you_mean

        parser.error(f"--from {args.source}: no such built-in recipe{did_you_mean(args.source, built_in_recipes())}; "
                     f"choose one of {', '.join(built_in_recipes())}")
    written = files(args.name, args.dir, args.source)
    existing = [str(path) for path in written if path.exists()]
    if existing:
        parser.error(f"{', '.join(existing)} exists already; choose another NAME or --dir (nothing was written)")
    done: list[Path] = []
    try:  # all or nothing: the files written before one that cannot be are removed again
        for path, text in written.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("x", encoding="utf-8") as f:  # never over a file that appeared meanwhile
                done.append(path)
                f.write(text)
    except OSError as exc:
        for path in done:
            path.unlink(missing_ok=True)
        if write_refused(exc):  # a full disk, a read-only directory: the router's one line, exit 74
            raise
        raise UsageError(f"{cannot_write(exc)} (nothing was written)") from None  # a file in the way of a directory
    for path in written:
        print(f"wrote {path}")
    print(f"run it: ampctl train -cd {args.dir} -cn {args.name}")


COMMAND = Command(name="init", summary="write an editable experiment config and recipe of your own",
                  section=Section.SETUP, main=main, arguments=arguments)
