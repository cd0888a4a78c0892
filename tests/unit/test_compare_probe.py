"""A comparison on a CPU that contradicts the CPU probe has the CPU measured again (studies/compare.py)."""

from __future__ import annotations

import json

import pytest

from ampctl.analysis import cpu_speed
from ampctl.studies.compare import ModePlan, recheck_cpu_probe
from tests.support.simulated_cpu import AVX2_ONLY, AVX512_BF16, simulated

PLANS = [ModePlan("fp32", [], 10), ModePlan("bf16", [], 10, "cpu", "bfloat16")]


def comparison(tmp_path, low: float, high: float):
    rows = [{"precision": "fp32", "speedup": 1.0, "speedup_low": 1.0, "speedup_high": 1.0},
            {"precision": "bf16", "speedup": (low + high) / 2, "speedup_low": low, "speedup_high": high}]
    (tmp_path / "comparison.json").write_text(json.dumps({"rows": rows}))
    return tmp_path


@pytest.mark.parametrize("probe_bf16,flags,low,high,measured_again", [
    (16.0, AVX2_ONLY, 1.2, 1.5, True),  # the probe said slow; bf16 measured faster: contradicted
    (16.0, AVX2_ONLY, 0.05, 0.08, False),  # slow, as the probe said
    (0.45, AVX512_BF16, 0.2, 0.5, True),  # the probe said fast; bf16 measured 2-5x slower: contradicted
    (0.45, AVX512_BF16, 0.9, 1.8, False),  # within the interval nothing is contradicted
])
def test_a_contradicting_comparison_measures_the_cpu_again(tmp_path, monkeypatch, probe_bf16, flags, low, high,
                                                          measured_again):
    calls = []
    cached, fresh = simulated(probe_bf16, 30.0, flags), simulated(0.5, 30.0, flags)
    monkeypatch.setattr(cpu_speed, "measured", lambda remeasure=False: calls.append(remeasure) or (
        fresh if remeasure else cached))
    lines = recheck_cpu_probe(PLANS, comparison(tmp_path, low, high))
    assert (True in calls) == measured_again
    if measured_again:
        assert lines[0].startswith("bf16 measured ") and "the CPU was measured again" in lines[0]
        assert any("bfloat16 autocast matmuls: 0.5x fp32's time" in line for line in lines)
    else:
        assert lines == []
