"""Text for the language-model recipes (gpt, hf_causal_lm): a local corpus read as bytes, and endless batches of
random windows of its tokens drawn on the device.

The default corpus is the Python standard library's own source, which every machine with Python has, so no
recipe needs a download. Any text file or directory of text files can replace it.
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

import torch

from ampctl.errors import UsageError

BYTE_VOCAB_SIZE = 256  # a byte-level vocabulary: every byte is a token


def default_corpus_files() -> Iterator[Path]:
    """The standard library's .py files, in sorted order so that the corpus is the same on every run."""
    return python_files_in_path_order(Path(sysconfig.get_paths()["stdlib"]))


def python_files_in_path_order(directory: Path) -> Iterator[Path]:
    """What `sorted(directory.rglob("*.py"))` lists, in its order, found as they are read: a corpus of a few
    hundred kB is the first few dozen of the standard library's ~13,000 files, and listing all of them took 3-6 s
    of every run. A path sorts by its parts, so a directory's files come where its name sorts among its siblings;
    links to directories are not followed, as rglob does not follow them."""
    try:
        entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from python_files_in_path_order(Path(entry.path))
        elif entry.name.endswith(".py"):
            yield Path(entry.path)


def read_corpus(corpus: Optional[str], max_bytes: int) -> bytes:
    """Up to max_bytes of the corpus: a text file, a directory of them (sorted), or the standard library."""
    if corpus is None:
        files = default_corpus_files()
    else:
        path = Path(corpus).expanduser()
        if not path.exists():
            raise UsageError(f"recipe.corpus={corpus!r} does not exist: give a text file or a directory of them")
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    chunks, size = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if not size and corpus is not None:  # torch.frombuffer's "both buffer length (0) and count (-1)" otherwise
        raise UsageError(f"recipe.corpus={corpus!r} holds 0 bytes: give a text file, or a directory of them, that "
                         "is not empty")
    return b"".join(chunks)[:max_bytes]


# The corpus's last tenth is held out for evaluation: training windows never reach into it (nanoGPT's 90/10)
HELD_OUT_FRACTION = 0.1


def check_corpus_length(corpus: Optional[str], tokens: int, block_size: int, unit: str = "bytes",
                        max_corpus_bytes: Optional[int] = None) -> None:
    """Training draws windows of block_size + 1 tokens (inputs and their next-token targets) from at least two
    places of the first nine tenths; the last tenth holds at least one window. The key named is the one to
    change: recipe.max_corpus_bytes when it cut the corpus below that, else recipe.corpus."""
    needed = math.ceil((block_size + 1) / HELD_OUT_FRACTION)
    if tokens < needed:
        where = corpus if corpus is not None else "the standard library"
        held = (f"recipe.max_corpus_bytes={max_corpus_bytes} keeps {tokens} {unit} of {where}"
                if max_corpus_bytes is not None and max_corpus_bytes < needed else
                f"recipe.corpus={where!r} holds {tokens} {unit}")
        raise UsageError(f"{held}; at least {needed} are needed for "
                         f"block_size={block_size} (training windows in the first nine tenths, a held-out window of "
                         "block_size + 1 in the last tenth)")


def split(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(training tokens, held-out tokens): the corpus's first nine tenths and its last tenth."""
    held_out = int(tokens.numel() * HELD_OUT_FRACTION)
    return tokens[:tokens.numel() - held_out], tokens[tokens.numel() - held_out:]


def held_out_windows(tokens: torch.Tensor, block_size: int, batch_size: int,
                     device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out tokens as consecutive windows that do not overlap, batch by batch, in order: the same batches on
    every call; the last batch may be short."""
    data = tokens.to(device)
    windows = (data.numel() - 1) // block_size
    for first in range(0, windows, batch_size):
        starts = torch.arange(first, min(first + batch_size, windows), device=device) * block_size
        window = data[starts[:, None] + torch.arange(block_size + 1, device=device)].long()
        yield window[:, :-1], window[:, 1:]


def token_windows(tokens: torch.Tensor, block_size: int, batch_size: int, device: torch.device,
                  seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, next-token targets) batches of random windows, as nanoGPT's get_batch draws them, but
    with the tokens on the device once and the windows drawn there: no host->device copy per step."""
    data = tokens.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    offsets = torch.arange(block_size + 1, device=device)
    high = data.numel() - block_size - 1
    while True:
        starts = torch.randint(high, (batch_size, 1), generator=gen, device=device)
        window = data[starts + offsets].long()
        yield window[:, :-1], window[:, 1:]
