"""What a resume costs in data: the time to a resumed run's first batch at steps 100 and 1,000, for an image folder
read through timm's training transforms (recipe=timm recipe.data=imagefolder), when the stream is replayed (every
earlier batch loaded, decoded and augmented again and thrown away: ampctl before the loader could start anywhere)
and when it starts at the checkpoint's batch (recipes/images.py). The fresh start is the reference: a resume
should cost what a start costs.

    python benchmarks/resume_data.py [--images 256] [--size 96] [--batch 16] [--workers 2]

Each figure is the median of 3 rounds taken in turn (start, replay, from the position, for each step), so that a
busy machine slows them alike; it prints seconds and the ratio to a start.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ampctl.engine.loop import batch_stream  # noqa: E402
from ampctl.recipes.base import checked_batches  # noqa: E402
from ampctl.recipes.timm_models import TimmRecipe  # noqa: E402


def make_folder(root: Path, images: int, size: int) -> None:
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for i in range(images):
        label = root / f"class{i % 4}"
        label.mkdir(parents=True, exist_ok=True)
        pixels = torch.randint(0, 256, (size, size, 3), dtype=torch.uint8, generator=generator).numpy()
        Image.fromarray(pixels).save(label / f"{i}.jpg", quality=90)


def first_batch_s(recipe: TimmRecipe, position: int, replay: bool) -> float:
    cpu = torch.device("cpu")
    started = time.perf_counter()
    if replay:  # as the loop did for every recipe: the stream from its start, drawn and discarded
        stream = checked_batches(recipe.batches(cpu, 0), recipe)
        for _ in range(position):
            next(stream)
        next(stream)
    else:
        next(iter(batch_stream(recipe, cpu, 0, position)))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_folder(Path(tmp), args.images, args.size)
        recipe = TimmRecipe(model="resnet18", data="imagefolder", data_root=tmp, image_size=64,
                            batch_size=args.batch, num_workers=args.workers, num_classes=None)
        print(f"{args.images} JPEGs of {args.size}x{args.size} px, timm's training transforms at 64 px, batch "
              f"{args.batch}, {args.workers} DataLoader workers; median of {args.rounds} rounds")
        print(f"{'resume at step':>15} {'start (s)':>10} {'replayed (s)':>13} {'from it (s)':>12} "
              f"{'replayed/start':>15} {'from it/start':>14}")
        for step in (100, 1000):
            times: dict[str, list[float]] = {"start": [], "replayed": [], "from it": []}
            for _ in range(args.rounds):  # in turn: a busy machine slows each alike
                times["start"].append(first_batch_s(recipe, 0, replay=False))
                times["replayed"].append(first_batch_s(recipe, step, replay=True))
                times["from it"].append(first_batch_s(recipe, step, replay=False))
            start, replayed, from_it = (statistics.median(times[k]) for k in ("start", "replayed", "from it"))
            print(f"{step:>15} {start:>10.2f} {replayed:>13.2f} {from_it:>12.2f} {replayed / start:>14.1f}x "
                  f"{from_it / start:>13.2f}x")


if __name__ == "__main__":
    main()
