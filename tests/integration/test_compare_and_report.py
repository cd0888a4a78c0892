"""ampctl compare, the sweep report after `train -m`, and `ampctl report` on each kind of directory."""

from __future__ import annotations

import csv
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import pytest
import torch

from ampctl.cli import main
from ampctl.engine import host_memory

REPO = Path(__file__).resolve().parents[2]
TINY = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.steps=8", "train.log_every=4"]


def read_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def assert_png(path: Path) -> None:
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.fixture(scope="module")
def comparison(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compare") / "cmp"
    saved = sys.argv[:]
    try:
        main(["compare", *TINY, "train.steps=12", "compare.precisions=[fp32,bf16,tf32]", "compare.warmup_steps=2",
              f"hydra.run.dir={out}"])
    finally:
        sys.argv = saved
    return out


def test_compare_writes_table_csv_json_report_and_plots(comparison):
    rows = read_csv(comparison / "comparison.csv")
    assert [r["precision"] for r in rows] == ["fp32", "bf16", "tf32"]
    fp32, bf16, tf32 = rows
    assert fp32["status"] == bf16["status"] == "ok" and float(fp32["speedup"]) == 1.0
    assert float(bf16["speedup"]) > 0 and float(bf16["memory_ratio"]) > 0
    assert abs(float(bf16["final_loss"]) - float(fp32["final_loss"])) < 0.05  # same batches, close numerics
    meta = json.loads((comparison / "comparison.json").read_text())
    assert meta["modes"] == ["fp32", "bf16"] and "tf32" in meta["skipped"]
    assert meta["machine"]["cpu_model"] and meta["machine"]["torch_version"]
    report_md = (comparison / "report.md").read_text()
    assert "| fp32 | ok |" in report_md and "tf32 skipped: needs TF32" in report_md and "![loss](loss.png)" in report_md
    for image in ("loss.png", "throughput_memory.png"):
        assert_png(comparison / image)
    for mode in ("fp32", "bf16"):  # each mode keeps its own run directory
        summary = json.loads((comparison / mode / "summary.json").read_text())
        assert summary["precision"] == mode and summary["timed_steps"] == 10


def test_compare_runs_every_mode_on_the_same_batches(comparison):
    """With the same seed and batches the first step's loss is the same in every mode (before any update)."""
    first = [json.loads((comparison / m / "metrics.jsonl").read_text().splitlines()[0])["loss"]
             for m in ("fp32", "bf16")]
    assert first[0] == pytest.approx(first[1], abs=2e-2)


def test_report_renders_a_compare_directory_again(comparison, capsys):
    (comparison / "comparison.csv").unlink()
    (comparison / "loss.png").unlink()
    main(["report", str(comparison)])  # returns normally: every mode finished
    assert (comparison / "comparison.csv").is_file() and (comparison / "loss.png").is_file()
    assert "precision comparison" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["precision=bf16"], "ampctl compare chooses the precision of each run"),
        (["compare.precisions=[fp32,fp99]"], "'fp99' is not a precision mode"),
        (["compare.precisions=[fp32,'nvfp4->bf99@0.5']"], "'bf99' is not a precision mode"),
        (["compare.precisions=[fp32,'nvfp4->bf16']"], "a scheduled row is MODE->MODE@POINT"),
        (["compare.precisions=[fp32,'nvfp4->bf16@8']"], "at or past the run's end (train.steps=8)"),
        (["compare.warmup_steps=-1"], "compare.warmup_steps=-1 is not allowed"),
        (["compare.rounds=0"], "compare.rounds=0 is not allowed: expected an integer >= 1"),
        (["compare.seeds=0"], "compare.seeds=0 is not allowed: expected an integer >= 1"),
        (["compare.warmup_steps=0", "compare.rounds=1", "train.eval.every=2", "train.checkpoint.save_top_k=1",
          "train.checkpoint.monitor=f1"], "train.checkpoint.monitor='f1' is not allowed"),
        (["compare.warmup_steps=2", "compare.rounds=5"], "compare.rounds=5: each round needs 2 steps or more after "
                                     "compare.warmup_steps=2 (its first is left out), and train.steps=8 leaves 6: "
                                     "raise train.steps to 12 or more, or lower compare.rounds"),
        (["resume=auto"], "ampctl compare starts fresh runs"),
        (["distributed=ddp"], "distributed=ddp: ampctl compare runs on one device"),
        (["compare.activation_checkpointing=[false,true]"], "recipe MLPRecipe names no blocks to checkpoint"),
        (["compare.optimizers=[adamw,adamw9bit]"], "compare.optimizers: 'adamw9bit' is not an optimizer (did you mean "
                                                   "adamw_8bit?)"),
        (["compare.optimizers=[sgd,sgd]"], "compare.optimizers=['sgd', 'sgd'] is not allowed: expected one or more "
                                           "distinct optimizers"),
    ],
)
def test_compare_refuses_bad_input_with_one_line(tmp_path, restore_argv, capsys, args, message):
    out = tmp_path / "cmp"
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *TINY, *args, f"hydra.run.dir={out}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_sweep_report_lists_every_job_and_failures(tmp_path, restore_argv, capsys):
    sweep = tmp_path / "sweep"
    with pytest.raises(SystemExit) as exit_info:  # one job fails: exit 1 after the table
        main(["train", "-m", "recipe=mlp,resnet", "precision=bf16", "train.steps=4", "train.console=quiet",
              f"hydra.sweep.dir={sweep}"])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    # each job as Hydra's launcher and its directory number it (#0, #1), of how many
    assert "job #0 (1 of 2: " in out and "job #1 (2 of 2: " in out and "job #1 failed: recipe.data_root=" in out
    rows = read_csv(sweep / "sweep.csv")
    assert [(r["job"], r["recipe"], r["status"]) for r in rows] == [("0", "mlp", "ok"), ("1", "resnet", "failed")]
    assert float(rows[0]["final_loss"]) > 0
    assert_png(sweep / "loss.png")
    assert said_written(out, sweep) == written_beside_the_jobs(sweep)
    # ampctl report renders it again, with the same exit status
    (sweep / "sweep.csv").unlink()
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(sweep)])
    assert exit_info.value.code == 1 and (sweep / "sweep.csv").is_file()


def said_written(out: str, directory: Path) -> set[str]:
    """The files the report's last line says it wrote in directory."""
    line = [line for line in out.splitlines() if line.startswith("wrote ")][-1]
    assert line.endswith(f" in {directory}"), line
    return set(line[len("wrote "):-len(f" in {directory}")].split(", "))


def written_beside_the_jobs(sweep: Path) -> set[str]:
    return {p.name for p in sweep.iterdir() if p.is_file() and p.name != "multirun.yaml"}


def test_a_sweep_whose_jobs_all_failed_says_it_drew_no_plot(tmp_path, restore_argv, capsys):
    """No job recorded a step (here: each refused its recipe; a sweep interrupted before its jobs finished has no
    finished job either): the report's line names the files it wrote, and no plot it did not draw."""
    sweep = tmp_path / "sweep"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "-m", "recipe=resnet", "recipe.batch_size=4,8", "train.steps=2", "train.console=quiet",
              f"hydra.sweep.dir={sweep}"])
    assert exit_info.value.code == 1
    assert said_written(capsys.readouterr().out, sweep) == written_beside_the_jobs(sweep) == {
        "sweep.csv", "sweep.json", "report.md"}


def quiet_or_busy(monkeypatch, others: float) -> None:
    """This process's view of the machine (ampctl/machine_load.py): other processes keep `others` cores busy,
    whatever the test machine does meanwhile (the suite's other worker)."""
    from ampctl import machine_load

    clock = iter(range(1, 10**6))
    monkeypatch.setattr(machine_load, "sample", lambda: (lambda t: machine_load.Sample(t, others * t, 0.0))(
        float(next(clock))))


def test_sweep_over_scaler_settings_has_one_column_per_swept_key(tmp_path, restore_argv, monkeypatch):
    quiet_or_busy(monkeypatch, 0.0)
    sweep = tmp_path / "sweep"
    main(["train", "-m", *TINY, "precision=fp16", "scaler.growth_interval=2,4", "scaler.init_scale=1e6,1e8",
          "train.console=quiet", f"hydra.sweep.dir={sweep}"])
    rows = read_csv(sweep / "sweep.csv")
    assert len(rows) == 4
    assert list(rows[0])[:3] == ["job", "scaler.growth_interval", "scaler.init_scale"]
    assert all(r["status"] == "ok" for r in rows)
    assert_png(sweep / "loss_scale.png")
    # the basic launcher runs the jobs one after another, with the same threads: their throughputs compare
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("[0-3]_*/summary.json"))]
    windows = [s["training_window"] for s in summaries]
    assert all(a[1] <= b[0] for a, b in zip(windows, windows[1:])) and all(w[0] < w[1] for w in windows)
    assert {s["torch_threads"] for s in summaries} == {torch.get_num_threads()}
    assert {s["host_memory_held"] for s in summaries} == {host_memory.glibc()}  # train.hold_host_memory's default
    assert "not comparable" not in (sweep / "report.md").read_text()
    # the same sweep beside other processes that take the machine: its table says its throughputs are not the jobs'
    quiet_or_busy(monkeypatch, 0.9 * (os.cpu_count() or 1))
    busy = tmp_path / "busy"
    main(["train", "-m", *TINY, "precision=fp16", "scaler.growth_interval=2,4", "train.console=quiet",
          f"hydra.sweep.dir={busy}"])
    assert "throughput not comparable between jobs: other processes took a share of the machine while #0, #1 ran" \
        in " ".join((busy / "report.md").read_text().split())


def test_report_on_a_single_run(tmp_path, restore_argv):
    run = tmp_path / "run"
    main(["train", *TINY, "precision=fp16", "train.console=quiet", f"hydra.run.dir={run}"])
    main(["report", str(run)])
    assert (run / "report.md").is_file() and (run / "run.csv").is_file()
    assert_png(run / "loss.png")


@pytest.mark.parametrize("make,message", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: p, "holds no ampctl runs"),
])
def test_report_refuses_bad_paths(tmp_path, capsys, make, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(make(tmp_path))])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("record", ["comparison.json", "memory.json", "ranges.json"])
def test_report_refuses_a_cut_record_in_one_line(tmp_path, capsys, record):
    (tmp_path / record).write_text('{"modes": [{"precision": "fp3')  # a write cut short
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{record} is not a whole ampctl record" in err, err
    assert [p.name for p in tmp_path.iterdir()] == [record]  # nothing written


def test_compare_shows_activation_checkpointing_side_by_side(tmp_path, restore_argv, capsys):
    out = tmp_path / "cmp"
    gpt = ["device=cpu", "recipe=gpt", "recipe.d_model=32", "recipe.n_layers=2", "recipe.n_heads=2",
           "recipe.block_size=64", "recipe.batch_size=4", "recipe.max_corpus_bytes=100000", "train.steps=4",
           "train.log_every=2", "compare.warmup_steps=1", "compare.rounds=1", "telemetry.profile_cpu_memory=false"]
    main(["compare", *gpt, "compare.precisions=[fp32,bf16]", "compare.activation_checkpointing=[false,true]",
          f"hydra.run.dir={out}"])
    rows = {r["precision"]: r for r in read_csv(out / "comparison.csv")}
    assert list(rows) == ["fp32", "fp32+ac", "bf16", "bf16+ac"]
    assert all(r["status"] == "ok" for r in rows.values())
    # recomputation changes memory and time, never the numbers
    assert rows["fp32+ac"]["final_loss"] == rows["fp32"]["final_loss"]
    assert rows["bf16+ac"]["final_loss"] == rows["bf16"]["final_loss"]


@pytest.mark.parametrize("bf16,expected", [(0.5, ["fp32", "bf16"]), (16.0, ["fp32"])], ids=["bf16-hardware", "no-bf16"])
def test_compare_runs_by_default_only_the_modes_that_are_fast_here(monkeypatch, bf16, expected):
    """On a CPU that emulates bf16 (16x slower than fp32 there), the default comparison leaves it out and says why;
    named in compare.precisions it runs."""
    from hydra import compose, initialize_config_module

    from ampctl.studies.compare import plan_modes
    from tests.support.simulated_cpu import AVX2_ONLY, AVX512_BF16, use_simulated

    use_simulated(monkeypatch, bf16, 30.0, AVX512_BF16 if bf16 < 1 else AVX2_ONLY)
    with initialize_config_module(config_module="ampctl.conf", version_base=None):
        plans, skipped = plan_modes(compose(config_name="compare", overrides=["device=cpu"]), ["device=cpu"])
        assert [p.mode for p in plans] == expected
        assert skipped["fp16"].startswith("float16 matmuls are converted in software on this CPU, which has no "
                                          "AVX512-FP16 or AMX-FP16 (measured: ")
        if bf16 > 1:
            assert skipped["bf16"].startswith("bfloat16 matmuls are converted in software on this CPU, which has no "
                                              "AVX512-BF16 or AMX-BF16 (measured: ")
            assert skipped["bf16"].endswith(" rounds of 512x512x512 matmuls); name it in compare.precisions to run it")
        named = compose(config_name="compare", overrides=["device=cpu", "compare.precisions=[fp32,bf16]"])
        assert [p.mode for p in plan_modes(named, ["device=cpu"])[0]] == ["fp32", "bf16"]


def test_optimizers_are_compared_as_rows_and_a_combination_that_cannot_run_is_skipped_with_its_reason():
    """compare.optimizers: each mode with each optimizer, labelled by it; stochastic rounding over fp32 weights (it
    would silently do nothing) is skipped with the optimizer's own refusal, not run and not a failed comparison."""
    from hydra import compose, initialize_config_module

    from ampctl.studies import row_labels
    from ampctl.studies.compare import plan_modes

    with initialize_config_module(config_module="ampctl.conf", version_base=None):
        cfg = compose(config_name="compare", overrides=["device=cpu", "compare.precisions=[fp32,bf16_true]",
                                                         "compare.optimizers=[adamw,adamw_bf16_sr]"])
        plans, skipped = plan_modes(cfg, ["device=cpu"])
    assert [p.mode for p in plans] == ["fp32+adamw", "bf16_true+adamw", "bf16_true+adamw_bf16_sr"]
    assert skipped["fp32+adamw_bf16_sr"].startswith("optimizer.bf16_stochastic_round=true rounds the bfloat16 weights")
    assert "optimizer=adamw_bf16_sr" in plans[2].overrides and "precision=bf16_true" in plans[2].overrides
    assert row_labels.parse("bf16_true+adamw_bf16_sr+compile").overrides() == ["optimizer=adamw_bf16_sr",
                                                                               "train.compile.enabled=true"]


def test_compare_takes_a_scheduled_mode_as_a_row(tmp_path, restore_argv, capsys):
    out = tmp_path / "cmp"
    main(["compare", *TINY, "compare.precisions=[fp32,'nvfp4->bf16@0.5']", "compare.rounds=1",
          "compare.warmup_steps=1", f"hydra.run.dir={out}"])
    rows = {r["precision"]: r for r in read_csv(out / "comparison.csv")}
    assert list(rows) == ["fp32", "nvfp4→bf16@0.5"] and all(r["status"] == "ok" for r in rows.values())
    summary = json.loads((out / "nvfp4_then_bf16@0.5" / "summary.json").read_text())
    assert summary["precision_scheduled"] == "nvfp4→bf16@0.5" and summary["schedule"][0]["after_step"] == 4
    assert "nvfp4→bf16@0.5: its rounds span its modes' steps (nvfp4, bf16 in turn)" in (out / "report.md").read_text()


def test_compare_runs_each_optimizer_against_the_first_one_in_fp32(tmp_path, restore_argv, capsys):
    out = tmp_path / "cmp"
    main(["compare", *TINY, "compare.precisions=[fp32]", "compare.optimizers=[adamw,sgd]", "compare.rounds=1",
          "compare.warmup_steps=1", f"hydra.run.dir={out}"])
    rows = {r["precision"]: r for r in read_csv(out / "comparison.csv")}
    assert list(rows) == ["fp32+adamw", "fp32+sgd"] and all(r["status"] == "ok" for r in rows.values())
    assert float(rows["fp32+adamw"]["speedup"]) == 1.0 and rows["fp32+sgd"]["final_loss"] != rows["fp32+adamw"][
        "final_loss"]
    summaries = {d.name: json.loads((d / "summary.json").read_text()) for d in out.glob("fp32+*") if d.is_dir()}
    assert {s["optimizer"] for s in summaries.values()} == {"torch.optim.AdamW", "torch.optim.SGD"}
    # what the figures are against: report.md's, with every definition (the screen says the decisions)
    assert "speedup, memory ratio and loss delta are against fp32+adamw (true fp32" in (out / "report.md").read_text()
    assert "loss delta are against" not in capsys.readouterr().out


def interrupt_compare(out: Path, *args: str, rows_before: int) -> str:
    """`ampctl compare` of fp32 and bf16 in a real process, SIGINT once fp32 has written rows_before rows: exit 130,
    one line, no traceback. Returns what it printed."""
    process = subprocess.Popen([sys.executable, "-m", "ampctl", "compare", *TINY, "train.steps=100000", *args,
                                "compare.precisions=[fp32,bf16]", f"hydra.run.dir={out}"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "fp32" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= rows_before):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "ampctl compare: interrupted (SIGINT)" in stderr, stderr
    return stdout


@pytest.mark.slow
def test_ctrl_c_during_compare_stops_the_running_mode_with_a_checkpoint_and_writes_the_partial_comparison(tmp_path):
    """SIGINT to compare reaches the running mode once (forwarded, never SIGKILL): it stops after its step with a
    checkpoint; the modes run so far are compared, the others listed as not run; exit 130."""
    out = tmp_path / "cmp"
    # a long warm-up: the first mode is still in it, the second not started, when the signal comes
    stdout = interrupt_compare(out, "compare.warmup_steps=50000", rows_before=8)
    metrics = out / "fp32" / "metrics.jsonl"
    step = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert (out / "fp32" / "checkpoints" / f"step_{step:08d}.pt").is_file()  # stopped gracefully at its step
    rows = {row["precision"]: row for row in read_csv(out / "comparison.csv")}
    assert rows["fp32"]["status"] == "interrupted" and rows["bf16"]["status"] == "skipped"
    continue_line = f"continue it with: ampctl train resume={out / 'fp32'}"
    assert f"fp32 interrupted: interrupted at step {step}; {continue_line}" in stdout
    assert "bf16 skipped: not run: the comparison was interrupted (SIGINT) before it started" in stdout


def test_a_failed_mode_shows_the_childs_own_error_line(tmp_path, restore_argv, capsys):
    out = tmp_path / "cmp"
    with pytest.raises(SystemExit):
        main(["compare", *TINY, "compare.precisions=[fp32]", "compare.warmup_steps=0", "compare.rounds=1",
              "recipe._target_=tests.support.broken_recipes.BrokenRecipe",
              "+recipe.mistake=finite_batches", f"hydra.run.dir={out}"])
    printed = capsys.readouterr().out
    assert ("fp32 failed: error: recipe tests.support.broken_recipes.BrokenRecipe: batches(device, seed) ended "
            "after step 3; the protocol needs an endless iterator") in " ".join(printed.split()), printed


def steps_by_process(log: Path) -> list[tuple[int, int, float, float]]:
    """(pid, step, start, end) of every step the TurnsRecipe ran, in the order they started."""
    rows = [line.split() for line in log.read_text().splitlines()]
    return sorted(((int(p), int(s), float(a), float(b)) for p, s, a, b in rows), key=lambda row: row[2])


def test_the_modes_take_turns_one_at_a_time_in_rounds_whose_order_rotates(tmp_path, restore_argv):
    """Three modes, 4 rounds of 3 steps after a warm-up of 2: each warms up in turn, then every round runs each
    mode's window while the others wait, in the order fp32 bf16 O0, then bf16 O0 fp32, and so on; no two steps of
    different modes ever overlap in time."""
    log, out = tmp_path / "steps.log", tmp_path / "cmp"
    main(["compare", *TINY, "recipe._target_=tests.support.turns_recipe.TurnsRecipe", f"+recipe.step_log={log}",
          "train.steps=14", "compare.warmup_steps=2", "compare.rounds=4", "compare.precisions=[fp32,bf16,O0]",
          f"hydra.run.dir={out}"])
    steps = steps_by_process(log)
    pids = list(dict.fromkeys(pid for pid, *_ in steps))  # in the order they started: fp32, bf16, O0
    assert len(pids) == 3 and len(steps) == 3 * 14
    blocks = [(pids.index(pid), [s for _, s, *_ in group]) for pid, group in
              itertools.groupby(steps, key=lambda row: row[0])]
    windows = [(1, 2), (3, 5), (6, 8), (9, 11), (12, 14)]
    expected = [(m, [1, 2]) for m in range(3)]  # the warm-ups
    for r, (first, last) in enumerate(windows[1:]):
        expected += [(m, list(range(first, last + 1))) for m in [(r + i) % 3 for i in range(3)]]
    assert blocks == expected
    for earlier, later in zip(steps, steps[1:]):
        if earlier[0] != later[0]:
            assert later[2] >= earlier[3]  # one process computing at a time
    meta = json.loads((out / "comparison.json").read_text())
    assert meta["rounds"] == [[3, 5], [6, 8], [9, 11], [12, 14]]
    rows = {r["precision"]: r for r in read_csv(out / "comparison.csv")}
    assert rows["O0"]["speed_verdict"] and float(rows["O0"]["speedup_low"]) <= float(rows["O0"]["speedup_high"])


def test_a_mode_that_fails_mid_rounds_leaves_the_others_taking_their_turns(tmp_path, restore_argv, capsys):
    out, log = tmp_path / "cmp", tmp_path / "steps.log"
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *TINY, "recipe._target_=tests.support.turns_recipe.TurnsRecipe", f"+recipe.step_log={log}",
              "+recipe.fail_half_at=7", "train.steps=14", "compare.warmup_steps=2", "compare.rounds=4",
              "compare.precisions=[fp32,bf16]", f"hydra.run.dir={out}"])
    assert exit_info.value.code == 1
    rows = {r["precision"]: r for r in read_csv(out / "comparison.csv")}
    assert rows["fp32"]["status"] == "ok" and rows["bf16"]["status"] == "failed"
    assert json.loads((out / "fp32" / "summary.json").read_text())["steps"] == 14
    assert ("bf16 failed: stopped: recipe tests.support.turns_recipe.TurnsRecipe: loss() raised RuntimeError at step 7 "
            "under precision=bf16: half precision failed at step 7") in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_ctrl_c_between_turns_stops_every_mode_with_a_checkpoint(tmp_path):
    """A SIGINT while one mode computes and the other waits for its turn: both stop after their step with a
    checkpoint, both are interrupted in the comparison, exit 130, no traceback."""
    out = tmp_path / "cmp"
    interrupt_compare(out, "compare.warmup_steps=2", rows_before=10)  # in round 1: bf16 waits for its turn
    rows = {row["precision"]: row for row in read_csv(out / "comparison.csv")}
    for mode in ("fp32", "bf16"):
        step = json.loads((out / mode / "metrics.jsonl").read_text().splitlines()[-1])["step"]
        assert (out / mode / "checkpoints" / f"step_{step:08d}.pt").is_file()
        assert rows[mode]["status"] == "interrupted"


@pytest.mark.slow
def test_compare_with_seeds_pairs_the_runs_and_judges_parity_against_seed_noise(tmp_path, restore_argv):
    """Three seeds per mode: each mode's held-out loss is the mean of its runs' own last evaluations, the
    difference the mean of the paired differences (the same seed's runs), the parity verdict follows from them;
    the timings pool every seed's rounds. `ampctl report` renders the same table again."""
    import statistics

    from omegaconf import OmegaConf

    out = tmp_path / "cmp"
    main(["compare", *TINY, "train.steps=12", "train.seed=5", "compare.warmup_steps=2", "compare.rounds=2",
          "compare.seeds=3", "compare.precisions=[fp32,bf16]", f"hydra.run.dir={out}"])
    summaries = {mode: [json.loads((out / mode / f"seed_{seed}" / "summary.json").read_text()) for seed in (5, 6, 7)]
                 for mode in ("fp32", "bf16")}
    for mode in summaries:
        seeds = [OmegaConf.load(out / mode / f"seed_{s}" / ".hydra" / "config.yaml").train.seed for s in (5, 6, 7)]
        assert seeds == [5, 6, 7]
    loss = {mode: [s["eval"]["eval/loss"] for s in runs] for mode, runs in summaries.items()}
    assert all(s["eval"]["step"] == 12 for runs in summaries.values() for s in runs)  # evaluated at the end
    rows = {r["precision"]: r for r in read_csv(out / "comparison.csv")}
    assert float(rows["fp32"]["eval_loss"]) == pytest.approx(statistics.fmean(loss["fp32"]))
    assert float(rows["bf16"]["eval_loss"]) == pytest.approx(statistics.fmean(loss["bf16"]))
    differences = [b - f for f, b in zip(loss["fp32"], loss["bf16"])]
    assert float(rows["bf16"]["eval_loss_delta"]) == pytest.approx(statistics.fmean(differences))
    half = 4.303 * statistics.stdev(differences) / 3 ** 0.5
    assert float(rows["bf16"]["eval_loss_delta_interval"]) == pytest.approx(half)
    sd = statistics.stdev(loss["fp32"])
    gap = abs(statistics.fmean(differences))
    expected = "matches" if gap + half <= sd else "differs" if gap - half > sd else "undecided"
    assert rows["bf16"]["parity"] == expected and rows["bf16"]["seeds"] == "3"
    meta = json.loads((out / "comparison.json").read_text())
    assert meta["seeds"] == [5, 6, 7] and "over 6 rounds" in rows["bf16"]["speed_verdict"]
    assert_png(out / "held_out.png")
    assert_png(out / "loss.png")
    before = (out / "comparison.csv").read_text()
    (out / "comparison.csv").unlink()
    main(["report", str(out)])
    assert (out / "comparison.csv").read_text() == before


@pytest.mark.slow
def test_compare_runs_every_optimizer_ampctl_list_names(tmp_path, restore_argv):
    """Each optimizer a row, trained to the end in its own process with its peak measured (torchao's compile their
    update on the first step, inside the measured window of a training run); an optimizer that needs pure bf16
    weights is trained under bf16_true and refused under fp32 with its reason."""
    from tests.support.configs import optimizers_each_with_a_precision

    pairs = optimizers_each_with_a_precision(installed_only=True)
    installed = [optimizer for optimizer, _ in pairs]
    out = tmp_path / "cmp"
    main(["compare", *TINY, "compare.precisions=[fp32,bf16_true]", f"compare.optimizers=[{','.join(installed)}]",
          "compare.rounds=1", "compare.warmup_steps=1", f"hydra.run.dir={out}"])
    rows = {r["precision"]: r for r in read_csv(out / "comparison.csv")}
    needs_bf16 = {optimizer for optimizer, precision in pairs if precision == "bf16_true"}
    for optimizer in installed:
        for precision in ("fp32", "bf16_true"):
            row = rows[f"{precision}+{optimizer}"]
            if precision == "fp32" and optimizer in needs_bf16:
                assert row["status"] == "skipped", row
                continue
            assert row["status"] == "ok" and float(row["peak_memory_mib"]) > 0, row
            assert float(row["final_loss"]) > 0


def test_on_a_busy_cpu_every_mode_runs_on_the_threads_left_free_and_the_comparison_says_so(tmp_path, restore_argv,
                                                                                             capsys, monkeypatch):
    """compare watches the machine before it starts (machine_load, made busy here); its modes' runs get
    train.threads: their summaries record the threads they computed on."""
    from ampctl import machine_load
    from ampctl.studies import turns

    clock = iter(range(1, 1000))
    monkeypatch.setattr(machine_load, "sample", lambda: (lambda t: machine_load.Sample(t, 1.96 * t, 0.0))(
        float(next(clock))))
    monkeypatch.setattr(machine_load, "cores", lambda: 2)
    monkeypatch.setattr(turns, "LOAD_SAMPLE_S", 0.0)
    out = tmp_path / "cmp"
    main(["compare", *TINY, "compare.precisions=[fp32]", "compare.rounds=1", "compare.warmup_steps=1",
          f"hydra.run.dir={out}"])
    printed = capsys.readouterr().out
    assert "the machine is busy (other processes used 2.0 of 2 cores): every mode runs on 1 thread " \
           "(train.threads=1)" in " ".join(printed.split())
    assert json.loads((out / "fp32" / "summary.json").read_text())["torch_threads"] == 1


def test_compare_with_train_profile_says_what_each_modes_matmuls_ran_in(tmp_path):
    """train.profile=N reaches each mode's run; the comparison's notes say each mode's matmul FLOPs by dtype (its
    first seed's profiled window), as its run's summary records them."""
    from tests.support.in_process import run_ampctl

    done = run_ampctl("compare", *TINY, "train.steps=20", "train.profile=2", "compare.precisions=[fp32,bf16]",
                      "compare.seeds=1", f"hydra.run.dir={tmp_path / 'cmp'}")
    assert done.returncode == 0, done.stderr
    notes = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["notes"]
    assert "fp32 matmul FLOPs (its profiled steps): 100.0% in float32." in notes
    assert "bf16 matmul FLOPs (its profiled steps): 100.0% in bfloat16." in notes
    # too few steps for the window: refused once, before any mode runs (each mode was a failed row)
    short = run_ampctl("compare", *TINY, "train.steps=14", "train.profile=4", "compare.precisions=[fp32,bf16]",
                       f"hydra.run.dir={tmp_path / 'short'}")
    assert short.returncode == 2 and short.stderr.count("\n") == 1, short.stderr
    assert "train.profile=4: the profiled steps would be 12-15, past train.steps=14" in short.stderr
    assert not (tmp_path / "short").exists()
