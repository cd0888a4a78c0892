"""timm: any model of PyTorch Image Models by name, randomly initialised (no download) or from a local checkpoint,
on synthetic ImageNet-shaped batches or a local image folder read with the model's own training transforms.

timm is an optional extra (`pip install 'ampctl[timm]'`), imported when this recipe is chosen. What the runner
needs to know about the model's structure comes from timm itself: its blocks (for activation checkpointing,
regional compilation and FSDP wrapping) are the fine-grained groups of the model's own group_matcher, the
groups timm's layer-wise learning-rate decay uses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ampctl.conf.messages import did_you_mean
from ampctl.errors import ConfigError, UsageError
from ampctl.recipes.base import plain_dict, require_positive
from ampctl.recipes.images import (
    dataset_batches,
    dataset_eval_batches,
    resolve_num_workers,
    synthetic_batches,
    synthetic_eval_batches,
)
from ampctl.recipes.libraries import import_library, library_calls
from ampctl.recipes.metrics import ImageClassification

DATASETS = ("synthetic", "imagefolder")
SYNTHETIC_CLASSES = 1000  # ImageNet's


def import_timm() -> Any:
    return import_library("timm", "recipe=timm", extra="timm")


@dataclass
class TimmRecipe(ImageClassification):
    model: str = "vit_tiny_patch16_224"
    model_kwargs: dict = field(default_factory=dict)  # passed to timm.create_model (depth=, drop_path_rate=, ...)
    checkpoint: Optional[str] = None
    data: str = "synthetic"
    data_root: Optional[str] = None
    eval_root: Optional[str] = None  # imagefolder's held-out images, a folder laid out as data_root
    image_size: int = 224
    batch_size: int = 32
    num_classes: Optional[int] = None  # null: 1000 for synthetic, the folder's classes for imagefolder
    channels_last: Optional[bool] = None  # null: for convolutional networks (more than a patch-embedding conv)
    num_workers: Optional[int] = None  # imagefolder's DataLoader worker processes; null: one per core, up to 8

    def __post_init__(self) -> None:
        self.model_kwargs = plain_dict(self.model_kwargs)
        timm = import_timm()
        if not timm.is_model(self.model):
            names = timm.list_models()
            raise UsageError(f"recipe.model={self.model!r}: no such timm model{did_you_mean(self.model, names)}; "
                             "timm.list_models('*pattern*') lists them")
        if self.data not in DATASETS:
            raise ConfigError("recipe.data", self.data, " | ".join(DATASETS))
        require_positive(self, "batch_size", "image_size")
        self.num_workers = resolve_num_workers(self.num_workers)
        if self.checkpoint is not None and not Path(self.checkpoint).expanduser().is_file():
            raise UsageError(f"recipe.checkpoint={self.checkpoint!r} is not a file: give a local weights file "
                             "(.pth, .safetensors) for timm to load, or null for random weights")
        self._pretrained_cfg = timm.models.get_pretrained_cfg(self.model)
        self._dataset = self._eval_dataset = None
        if self.data == "imagefolder":
            self._dataset = self._open_imagefolder(self.data_root, "data_root", training=True)
            if self.eval_root is not None:
                self._eval_dataset = self._open_imagefolder(self.eval_root, "eval_root", training=False)
        if self.num_classes is None:
            self.num_classes = len(self._dataset.classes) if self._dataset is not None else SYNTHETIC_CLASSES
        elif self.num_classes < 2:
            raise ConfigError("recipe.num_classes", self.num_classes, "an integer >= 2, or null")
        self.samples_per_batch = self.batch_size
        self.tokens_per_batch = None

    def _open_imagefolder(self, folder: Optional[str], key: str, training: bool) -> Any:
        """recipe.data_root (training: the model's own training transforms, its mean, std, interpolation and
        crop, at recipe.image_size) or recipe.eval_root (its evaluation transforms)."""
        from timm.data import create_transform, resolve_data_config
        from torchvision import datasets

        if folder is None:
            raise UsageError("recipe.data=imagefolder needs recipe.data_root: a folder with one folder of images "
                             "per class (root/cat/1.jpg, root/dog/2.png)")
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise UsageError(f"recipe.{key}={folder!r} is not a directory: give a folder with one "
                             "folder of images per class (root/cat/1.jpg, root/dog/2.png)")
        data_cfg = resolve_data_config(args={"input_size": (3, self.image_size, self.image_size)},
                                       pretrained_cfg=self._pretrained_config())
        try:
            dataset = datasets.ImageFolder(str(root), transform=create_transform(**data_cfg, is_training=training))
        except (FileNotFoundError, OSError) as exc:
            raise UsageError(f"recipe.{key}={folder!r} holds no images: {str(exc).splitlines()[0]} "
                             "(one folder of images per class: root/cat/1.jpg, root/dog/2.png)") from None
        if training and len(dataset) < self.batch_size:
            raise UsageError(f"recipe.data_root={folder!r} holds {len(dataset)} images, fewer than one batch "
                             f"(recipe.batch_size={self.batch_size}); lower the batch size or add images")
        if self._dataset is not None and dataset.classes != self._dataset.classes:
            raise UsageError(f"recipe.eval_root={folder!r} has the classes {dataset.classes[:5]}..., "
                             f"recipe.data_root {self._dataset.classes[:5]}...: give both the same class folders")
        return dataset

    def _pretrained_config(self) -> dict:
        return self._pretrained_cfg.to_dict() if self._pretrained_cfg is not None else {}

    def build_model(self) -> nn.Module:
        with library_calls("recipe=timm"):
            model = self._create()
        if self.checkpoint is not None:
            self._load_checkpoint(model)
        if self._nhwc():  # convolutions in NHWC: cuDNN's and oneDNN's fastest half-precision kernels
            model = model.to(memory_format=torch.channels_last)
        return model

    def _create(self) -> nn.Module:
        timm = import_timm()
        kwargs = dict(self.model_kwargs)
        if self._pretrained_config().get("fixed_input_size"):  # ViTs size their position embeddings for it
            kwargs.setdefault("img_size", self.image_size)
        try:
            return timm.create_model(self.model, pretrained=False, num_classes=self.num_classes, **kwargs)
        except TypeError as exc:
            unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
            if unexpected is None:
                raise
            raise UsageError(f"recipe.model_kwargs.{unexpected.group(1)}: {self.model} takes no such argument; "
                             "see its class in timm for the ones it takes") from None

    def _nhwc(self) -> bool:
        """recipe.channels_last, or (null) whether the model is convolutional: more than one Conv2d, which a
        ViT's patch embedding alone is not. Decided once, on a model built on the meta device."""
        if self.channels_last is None:
            with torch.device("meta"):
                model = self._create()
            self.channels_last = sum(isinstance(m, nn.Conv2d) for m in model.modules()) > 1
        return self.channels_last

    def _load_checkpoint(self, model: nn.Module) -> None:
        try:
            import_timm().models.load_checkpoint(model, str(Path(self.checkpoint).expanduser()), strict=True)
        except (RuntimeError, KeyError, ValueError, OSError) as exc:
            raise UsageError(f"recipe.checkpoint={self.checkpoint!r} could not be loaded into {self.model}: "
                             f"{str(exc).strip().splitlines()[0]}") from None

    def activation_checkpoint_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The model's blocks as timm groups them (group_matcher(coarse=False)['blocks']: a ViT's blocks, a
        ResNet's residual blocks, a ConvNeXt's stage blocks): the outermost modules with children whose name the
        patterns match."""
        matcher = model.group_matcher(coarse=False) if hasattr(model, "group_matcher") else {}
        patterns = matcher.get("blocks", [])
        patterns = [patterns] if isinstance(patterns, str) else [p[0] if isinstance(p, tuple) else p for p in patterns]
        compiled = [re.compile(p) for p in patterns]
        blocks, taken = [], []
        for name, module in model.named_modules():
            if not name or not any(True for _ in module.children()):
                continue
            if any(name.startswith(t + ".") for t in taken):
                continue
            if any(p.match(name) for p in compiled):
                blocks.append(module)
                taken.append(name)
        return blocks

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.batches_from(device, seed, 0)

    def batches_from(self, device: torch.device, seed: int,
                     position: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The stream of batches(device, seed) from its position-th batch, reading no image before it."""
        if self._dataset is None:
            return synthetic_batches(self.batch_size, self.image_size, self.num_classes, self._nhwc(), device, seed,
                                     position)
        return dataset_batches(self._dataset, self.batch_size, self.num_workers, self._nhwc(), device, seed, position)

    def eval_batches(self, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """recipe.eval_root's images with the model's evaluation transforms (imagefolder), or held-out synthetic
        batches."""
        if self._dataset is None:
            return synthetic_eval_batches(self.batch_size, self.image_size, self.num_classes,  # type: ignore[arg-type]
                                          self._nhwc(), device)
        if self._eval_dataset is None:
            raise UsageError("train.eval.every with recipe.data=imagefolder needs recipe.eval_root: a folder of "
                             "held-out images laid out as recipe.data_root (root/cat/1.jpg, root/dog/2.png)")
        return dataset_eval_batches(self._eval_dataset, self.batch_size, self.num_workers, self._nhwc(), device)
