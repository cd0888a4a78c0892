"""`ampctl memory` end to end on the CPU: the table's files, the activation saving of bf16 and of
activation checkpointing in the measured peak, and bad input."""

from __future__ import annotations

import json
import re

import pytest

from ampctl.cli import main
from tests.support.configs import optimizers_each_with_a_precision

# activation-heavy: long context, narrow model
HEAVY = ["device=cpu", "recipe=gpt", "recipe.d_model=64", "recipe.n_layers=4", "recipe.n_heads=4",
         "recipe.block_size=256", "recipe.batch_size=8", "recipe.max_corpus_bytes=300000", "memory.timed_steps=1"]


@pytest.mark.slow
def test_memory_shows_the_activation_saving_of_bf16_and_of_checkpointing(tmp_path, restore_argv, capsys):
    out = tmp_path / "memory"
    main(["memory", *HEAVY, "memory.precisions=[fp32,bf16]", "memory.activation_checkpointing=[false,true]",
          "memory.budget=1GiB", f"hydra.run.dir={out}"])
    printed = capsys.readouterr().out
    assert "memory per precision mode (budget 1GiB)" in printed
    # progress while it measures: per mode, a line per finished phase with its seconds
    phases = re.findall(r"^    (built the model|measured step \d/2|read the CPU memory timeline|timed step 1/1)\b",
                        printed, flags=re.MULTILINE)
    assert phases == ["built the model", "measured step 1/2", "measured step 2/2", "read the CPU memory timeline",
                      "timed step 1/1"] * 4, phases
    data = json.loads((out / "memory.json").read_text())
    modes = {m["precision"]: m for m in data["modes"]}
    assert list(modes) == ["fp32", "fp32+ac", "bf16", "bf16+ac"]
    assert all(m["measured_source"].startswith("torch memory profiler") for m in modes.values())
    peak = {k: m["measured_peak"] for k, m in modes.items()}
    # bf16 halves most activations; checkpointing keeps only the blocks' inputs
    assert peak["bf16"] < 0.8 * peak["fp32"], peak
    assert peak["fp32+ac"] < 0.6 * peak["fp32"] and peak["bf16+ac"] < 0.6 * peak["bf16"], peak
    assert modes["bf16"]["measured_breakdown"]["activations"] < modes["fp32"]["measured_breakdown"]["activations"]
    for m in modes.values():
        # the count of saved activations is close to the activations the profiler sees at the peak
        assert m["estimate"] == m["model_states"]["total"] + m["activations"]
        assert m["batch_estimate"] > m["batch_size"] and m["batch_found"] is None  # no search on a CPU
    assert modes["fp32"]["batch_estimate"] < modes["bf16"]["batch_estimate"] < modes["bf16+ac"]["batch_estimate"]
    rows = (out / "memory.csv").read_text().splitlines()
    assert rows[0].startswith("precision,weights_bytes,gradients_bytes,master_weights_bytes") and len(rows) == 5
    assert (out / "memory.png").is_file() and "![memory](memory.png)" in (out / "report.md").read_text()
    assert (out / "report.md").read_text().startswith("# memory per precision mode")
    # `ampctl report` renders the same table again from memory.json, without measuring
    before = (out / "memory.csv").read_text()
    (out / "memory.csv").unlink()
    main(["report", str(out)])
    assert (out / "memory.csv").read_text() == before


def test_the_weight_averages_row_is_what_it_adds_to_the_measured_peak(tmp_path, restore_argv, capsys):
    """train.ema.decay: the EMA column (4 bytes per parameter) is what the average adds to the peak the profiler
    measures, against the same run without one; its bars are in memory.png, its column only where it is kept."""
    peaks, states = {}, {}
    for ema in ("null", "0.999"):
        out = tmp_path / ema
        main(["memory", "device=cpu", "recipe=mlp", "recipe.hidden=512", "memory.timed_steps=1",
              f"train.ema.decay={ema}", f"hydra.run.dir={out}"])
        [mode] = json.loads((out / "memory.json").read_text())["modes"]
        peaks[ema], states[ema] = mode["measured_peak"], mode["model_states"]
        header = (out / "memory.csv").read_text().splitlines()[0]
        assert ("weight_average_bytes" in header) == (ema != "null")
    assert states["null"]["weight_average"] == 0
    added = states["0.999"]["weight_average"]
    assert added == states["null"]["weights"]  # fp32 weights, all trained: one more copy of them
    assert abs((peaks["0.999"] - peaks["null"]) - added) < 0.05 * added, (peaks, added)
    assert "EMA (train.ema.decay's fp32 average of the weights)" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["memory.budget=80XB"], "memory.budget='80XB' is not allowed: expected a size such as 80GB"),
    (["memory.budget=-3GB"], "memory.budget='-3GB' is not allowed"),
    (["memory.steps=0"], "memory.steps=0 is not allowed: expected an integer >= 1"),
    (["memory.precisions=[fp32,fp64]"], "'fp64' is not a precision mode"),
    (["precision=bf16", "memory.precisions=[fp32]"], "give the modes with memory.precisions=[...] or one precision="),
    (["memory.search=true"], "memory.search=true needs a CUDA device"),
    (["distributed=ddp"], "distributed=ddp: ampctl memory runs on one device"),
    (["recipe=mlp", "memory.activation_checkpointing=[true]"], "recipe MLPRecipe names no blocks to checkpoint"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, restore_argv, capsys, args, message):
    out = tmp_path / "memory"
    with pytest.raises(SystemExit) as exit_info:
        main(["memory", "device=cpu", "recipe=mlp", "recipe.hidden=16", *args, f"hydra.run.dir={out}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.slow
def test_a_probe_of_the_batch_search_reports_its_peak_from_its_own_process():
    import subprocess
    import sys

    small, large = (
        json.loads(subprocess.run([sys.executable, "-m", "ampctl.studies.memory_probe", str(batch), *HEAVY[:-1]],
                                  capture_output=True, text=True, check=True).stdout.splitlines()[-1])["peak"]
        for batch in (2, 8)
    )
    assert 0 < small < large


def test_the_search_doubles_then_bisects_to_the_largest_fitting_batch(monkeypatch):
    from ampctl.studies import memory as study

    probed = []

    def fake_fits(_overrides, _config_dir, batch, budget):
        probed.append(batch)
        peak = 1000 + 10 * batch
        return peak <= budget, peak

    monkeypatch.setattr(study, "_fits", fake_fits)
    log: list[str] = []
    assert study.search_batch([], None, 1000 + 10 * 150, 64, log) == 150
    assert probed[:3] == [64, 128, 256] and len(probed) <= study.SEARCH_PROBES
    assert log[0] == "batch 64: fits (peak 1.60 KiB)"  # 1640 bytes


@pytest.mark.parametrize("precision", ["fp32", "O2"])
def test_train_reports_the_peak_that_ampctl_memory_measures(tmp_path, restore_argv, precision):
    """One definition of peak memory everywhere: on a CPU, the allocator's peak from torch's memory profiler
    over the model build and the first two steps (process RSS, hundreds of MiB of interpreter and torch,
    is not it)."""
    from tests.support.training import train_here

    mlp = ["recipe=mlp", "recipe.hidden=256", "recipe.batch_size=128"]
    main(["memory", "device=cpu", *mlp, f"precision={precision}", f"hydra.run.dir={tmp_path / 'memory'}"])
    [mode] = json.loads((tmp_path / "memory" / "memory.json").read_text())["modes"]
    summary, _ = train_here(tmp_path / "train", *mlp, f"precision={precision}", "train.steps=4",
                       "telemetry.profile_cpu_memory=true",
                       "train.timing_warmup_steps=0")
    assert summary["peak_memory_source"].startswith("torch memory profiler (CPU allocator)")
    assert mode["measured_source"].startswith("torch memory profiler (CPU allocator)")
    assert summary["peak_memory_bytes"] == pytest.approx(mode["measured_peak"], rel=0.1)
    assert summary["peak_memory_bytes"] < 16 * 2**20  # a 0.15M-parameter MLP: a few MiB, not the process
    assert summary["timed_steps"] == 4 - 2  # the profiled steps are not timed


def test_a_memory_profile_that_torch_cannot_analyse_does_not_end_the_run(tmp_path, monkeypatch):
    """torch's memory-timeline analysis is private code and has asserted on an FSDP graph, and the events a run's
    peak is summed from are a private attribute: the run goes on and says the peak was not measured."""
    from ampctl.analysis.memory import measure
    from tests.support.training import train_here

    def fails(_prof):
        raise AssertionError("version mismatch")

    monkeypatch.setattr(measure, "_allocation_peak", fails)
    summary, rows = train_here(tmp_path, "train.steps=3", "telemetry.profile_cpu_memory=true")
    assert len(rows) == 3 and summary["peak_memory_bytes"] is None
    assert summary["peak_memory_source"] == ("not measured: torch's memory profiler could not analyse this run "
                                             "(AssertionError)")


def test_the_allocators_peak_is_the_timelines_less_the_memory_it_did_not_allocate():
    """A CPU peak is the running sum of the allocator's events (cheap); `ampctl memory`'s breakdown is torch's
    categorised memory timeline at its peak (a minute on a transformers model, so the gpt here). One window, in
    fp32 and under bf16 autocast: the timeline's total is the allocator's peak plus the corpus, a tensor over a
    Python buffer the allocator never allocated (the timeline counts tensors by their shapes)."""
    from ampctl.analysis.memory.measure import measure_peak
    from ampctl.engine.build import build_state
    from ampctl.engine.loop import run_steps
    from ampctl.recipes.base import build_recipe
    from ampctl.runner.plan import check_config
    from tests.support.training import QUIET, compose_cfg

    sizes = ["recipe.d_model=64", "recipe.n_layers=2", "recipe.block_size=64", "recipe.batch_size=4"]
    corpus = 100_000  # recipe.max_corpus_bytes, one byte a token
    for precision in ("fp32", "bf16"):
        cfg = compose_cfg(*QUIET, "recipe=gpt", *sizes, f"recipe.max_corpus_bytes={corpus}",
                          f"precision={precision}")
        policy = check_config(cfg)
        built = build_recipe(cfg.recipe)
        with policy, measure_peak(policy.device, by_category=True) as peak:
            state = build_state(cfg, policy, built)
            run_steps(state, built.batches(policy.device, 0), 2, built, policy)
        assert peak.bytes > 0 and sum(peak.breakdown.values()) - peak.bytes == corpus, (precision, peak)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,precision", optimizers_each_with_a_precision())
def test_memory_measures_every_optimizer_within_a_few_gigabytes_and_its_states_inside_the_peak(
        tmp_path, optimizer, precision):
    """torchao's optimizers compile their update on the first step; under the memory profiler that compile grew a
    0.15M-parameter MLP's `ampctl memory` to 22 GB. Each optimizer runs in a process under an 8 GiB address-space
    limit (torch's CUDA build maps ~4 GiB before it allocates anything) and ends well, its measured peak holding the
    weights and the optimizer states it allocated in its first measured step: the warm-up is outside the
    measurement, the states are not."""
    import resource
    import subprocess
    import sys

    limit = 8 * 2**30
    out = tmp_path / "memory"
    done = subprocess.run([sys.executable, "-m", "ampctl", "memory", "device=cpu", "recipe=mlp", "recipe.hidden=512",
                           f"optimizer={optimizer}", f"precision={precision}", "memory.timed_steps=1",
                           f"hydra.run.dir={out}"],
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "_stable_hash_for_caching" not in done.stderr, done.stderr
    [mode] = json.loads((out / "memory.json").read_text())["modes"]
    states = mode["model_states"]
    assert mode["measured_source"].startswith("torch memory profiler"), mode["measured_source"]
    assert states["optimizer_states"] > 0
    assert mode["measured_peak"] >= states["weights"] + states["optimizer_states"], (mode["measured_peak"], states)


def test_a_mixture_of_experts_model_states_per_part_in_the_files_and_again_from_them(tmp_path, restore_argv, capsys):
    """recipe=moe: the experts', routers' and the rest's model states in memory.json (adding up to the mode's), the
    table on screen and in report.md, and `ampctl report` writes the same table again from memory.json."""
    out = tmp_path / "memory"
    main(["memory", "device=cpu", "recipe=moe", "recipe.n_layers=1", "recipe.d_model=32", "recipe.n_heads=2",
          "recipe.experts=4", "recipe.expert_hidden=32", "recipe.block_size=16", "recipe.max_corpus_bytes=100000",
          "memory.precisions=[O2]", "memory.steps=1", "memory.timed_steps=1", f"hydra.run.dir={out}"])
    printed = capsys.readouterr().out
    assert "model states per part of the mixture of experts" in printed
    mode = json.loads((out / "memory.json").read_text())["modes"][0]
    parts = {p["part"]: p for p in mode["parts"]}
    assert list(parts) == ["experts", "routers", "the rest"] and parts["experts"]["parameters"] == 3 * 4 * 32 * 32
    assert sum(p["total"] for p in parts.values()) == mode["model_states"]["total"]
    report = (out / "report.md").read_text()
    assert "model states per part of the mixture of experts" in report
    (out / "report.md").unlink()
    main(["report", str(out)])
    assert (out / "report.md").read_text() == report
