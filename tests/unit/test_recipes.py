"""The built-in recipes train under the AMP modes; their data problems are one-line usage errors."""

from __future__ import annotations

import pytest
import torch

from ampctl.errors import UsageError
from ampctl.recipes.gpt import GPTRecipe


def test_gpt_corpus_defaults_to_the_stdlib_and_is_deterministic():
    a, b = GPTRecipe(max_corpus_bytes=10_000), GPTRecipe(max_corpus_bytes=10_000)
    assert len(a._data) == 10_000 and a._data == b._data
    x1, y1 = next(a.batches(torch.device("cpu"), seed=5))
    x2, _ = next(b.batches(torch.device("cpu"), seed=5))
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one


def test_gpt_refuses_a_corpus_shorter_than_a_block(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(UsageError, match=r"holds 4 bytes; at least 1290 are needed for block_size=128 \(training "
                                         r"windows in the first nine tenths, a held-out window of block_size \+ 1"):
        GPTRecipe(corpus=str(short))
