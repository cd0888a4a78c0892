"""The built-in recipes train under the AMP modes; their data problems are one-line usage errors."""

from __future__ import annotations

import pytest
import torch

from ampctl.errors import UsageError
from ampctl.recipes.gpt import GPTRecipe
from ampctl.recipes.text import python_files_in_path_order


def test_gpt_corpus_defaults_to_the_stdlib_and_is_deterministic():
    a, b = GPTRecipe(max_corpus_bytes=10_000), GPTRecipe(max_corpus_bytes=10_000)
    assert len(a._data) == 10_000 and a._data == b._data
    x1, y1 = next(a.batches(torch.device("cpu"), seed=5))
    x2, _ = next(b.batches(torch.device("cpu"), seed=5))
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one


def test_the_default_corpus_files_come_in_the_order_sorting_rglobs_list_gives(tmp_path):
    """Found lazily as the corpus is read, in the order `sorted(root.rglob("*.py"))` gives: a directory's files
    where its name sorts among its siblings (b/ before b.py, after a.py), names sorted as strings (B before a), a
    link to a directory not followed, a file matching nothing left out."""
    for name in ["a.py", "b/x.py", "b/c/y.py", "b/a.py", "b.py", "B.py", "b_/z.py", "c.txt", "d/e/f/g.py", ".py",
                 "b.pyc", "z/__init__.py"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    (tmp_path / "link").symlink_to(tmp_path / "b", target_is_directory=True)
    (tmp_path / "lnk.py").symlink_to(tmp_path / "a.py")
    found = list(python_files_in_path_order(tmp_path))
    assert found == sorted(tmp_path.rglob("*.py"))
    assert [str(p.relative_to(tmp_path)) for p in found][:6] == [".py", "B.py", "a.py", "b/a.py", "b/c/y.py", "b/x.py"]


def test_gpt_refuses_a_corpus_shorter_than_a_block(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(UsageError, match=r"holds 4 bytes; at least 1290 are needed for block_size=128 \(training "
                                         r"windows in the first nine tenths, a held-out window of block_size \+ 1"):
        GPTRecipe(corpus=str(short))
