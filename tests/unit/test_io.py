"""ampctl.io's shared helpers against their definitions."""

from __future__ import annotations

import pytest
import torch

from ampctl import io


def test_format_bytes_uses_binary_units():
    assert io.format_bytes(None) == "-"
    assert io.format_bytes(512) == "512 B"
    assert io.format_bytes(1536) == "1.50 KiB"  # 1536 / 2^10
    assert io.format_bytes(3 * 2**30 + 2**29, decimals=1) == "3.5 GiB"
    assert io.format_bytes(5 * 2**40) == "5.00 TiB"


def test_tensors_in_and_map_tensors_walk_nested_batches():
    a, b, c = torch.ones(2), torch.zeros(3, dtype=torch.int64), torch.full((1,), 2.0)
    batch = {"x": (a, [b, "label"]), "y": c, "n": 4}
    assert [t.data_ptr() for t in io.tensors_in(batch)] == [a.data_ptr(), b.data_ptr(), c.data_ptr()]
    doubled = io.map_tensors(batch, lambda t: t * 2)
    assert doubled["n"] == 4 and doubled["x"][1][1] == "label" and isinstance(doubled["x"], tuple)
    assert torch.equal(doubled["x"][0], a * 2) and torch.equal(doubled["y"], c * 2)


def test_a_drawn_float_reads_in_four_digits_and_everything_else_as_written():
    from ampctl.io import count_of, readable_override, readable_value

    assert readable_value("0.005461687968002626") == "0.005462"  # what Optuna's TPE draws
    assert [readable_value(v) for v in ("1e-3", "0.001", "2000", "[fp32,bf16]", "1099511627776")] == [
        "1e-3", "0.001", "2000", "[fp32,bf16]", "1099511627776"]
    assert readable_override("optimizer.lr=0.00805469883095217") == "optimizer.lr=0.008055"
    assert readable_override("recipe=mlp") == "recipe=mlp"
    assert (count_of(1, "step"), count_of(2, "step"), count_of(12000, "step")) == ("1 step", "2 steps", "12,000 steps")


def test_si_prefixed_counts_keep_three_digits():
    from ampctl.io import si_prefixed

    assert si_prefixed(4714) == ("4.71", "k") and si_prefixed(3_295_488) == ("3.3", "M")
    assert si_prefixed(42_882_564_096) == ("42.9", "G") and si_prefixed(12) == ("12", "")
    assert si_prefixed(999_999) == ("1", "M") and si_prefixed(999.4) == ("999", "")


def test_a_line_longer_than_the_terminal_breaks_at_word_boundaries_with_its_continuation_indented():
    from ampctl.io import wrap_words

    line = "  Selected precision=fp16: autocast=float16, model_weights=float32, master_weights=none, rules=none"
    wrapped = wrap_words(line, 40).split("\n")
    assert all(len(part) <= 40 for part in wrapped) and wrapped[0].startswith("  Selected")
    assert all(part.startswith("    ") for part in wrapped[1:])
    assert " ".join(part.strip() for part in wrapped) == line.strip()  # every word whole, none lost
    assert wrap_words("short", 40) == "short"
    long_path = "run_dir=/" + "x" * 60
    assert wrap_words(f"recipe=mlp {long_path}", 40) == f"recipe=mlp\n  {long_path}"  # a word longer stays whole


def test_a_record_is_written_whole_by_concurrent_writers_and_a_failed_write_leaves_no_temporary_file(tmp_path,
                                                                                                     monkeypatch):
    """Two writers of one record (a rank and a Hydra callback) used to share `<name>.tmp`: one renamed the other's
    half-written file into place, or found its own gone. Each now writes under a name of its own, fsyncs, renames."""
    import os
    import threading

    path = tmp_path / "summary.json"
    payloads = [bytes([i]) * 200_000 for i in range(8)]
    threads = [threading.Thread(target=lambda p=p: [io.atomic_write_bytes(path, p) for _ in range(20)])
               for p in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert path.read_bytes() in payloads  # one writer's whole record, never a mix
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]

    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    io.atomic_write_text(path, "new\n")
    assert path.read_text() == "new\n" and len(synced) == 2  # the file's bytes, then the directory's rename

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        io.atomic_write_text(path, "lost\n")
    assert path.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
