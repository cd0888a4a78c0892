"""The CLI end to end: in-process through the router (fast), and a few real subprocesses."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from ampctl.cli import main
from ampctl.shell.command import registry
from tests.support.in_process import run_ampctl

COMMANDS = list(registry())

FAST = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.steps=6", "train.log_every=3",
        "train.console=plain"]
REPO = Path(__file__).resolve().parents[2]
# The precision modes as the directory of their YAML files lists them (the one list there is), sorted as Hydra does.
PRECISION_MODES = sorted(path.stem for path in (REPO / "ampctl" / "conf" / "precision").glob("*.yaml"))


def ampctl(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ampctl", *args], capture_output=True, text=True, cwd=cwd or REPO,
        env={**os.environ, **(env or {})}, timeout=300,
    )


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --- in-process -------------------------------------------------------------------------------------


def test_train_writes_the_run_directory(tmp_path, restore_argv, capsys):
    run_dir = tmp_path / "run"
    main(["train", "precision=fp16", *FAST, f"hydra.run.dir={run_dir}"])
    out = capsys.readouterr().out
    assert out.startswith("Selected precision=fp16: autocast=float16")
    assert "step 3/6 |" in out and "step 6/6 |" in out and "done: 6 steps" in out
    records = rows(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    required = {"step", "loss", "loss_scale", "skipped", "skipped_total", "grad_norm", "lr", "step_time_ms",
                "samples_per_s"}
    assert all(required <= r.keys() for r in records)
    assert records[0]["loss_scale"] == 65536.0 and records[0]["skipped"] is False
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("precision", "recipe", "device", "torch_version", "steps", "final_loss", "skipped_total",
                "final_loss_scale", "median_step_time_ms", "samples_per_s", "peak_memory_bytes"):
        assert key in summary, key
    assert summary["precision"] == "fp16" and summary["recipe"] == "mlp" and summary["steps"] == 6
    assert summary["final_loss"] == records[-1]["loss"]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / ".hydra" / "overrides.yaml").is_file()


def test_a_language_model_reports_tokens_per_second(tmp_path, restore_argv):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    run_dir = tmp_path / "run"
    main(["train", "precision=bf16", "recipe=gpt", f"recipe.corpus={corpus}", "recipe.d_model=32",
          "recipe.n_layers=1", "recipe.n_heads=2", "recipe.block_size=16", "recipe.batch_size=4",
          "train.steps=4", "train.log_every=2", "train.console=quiet", f"hydra.run.dir={run_dir}"])
    assert all(r["tokens_per_s"] > 0 for r in rows(run_dir))
    assert json.loads((run_dir / "summary.json").read_text())["tokens_per_s"] > 0


def test_multirun_sweeps_scaler_settings(tmp_path, restore_argv, capsys):
    sweep_dir = tmp_path / "sweep"
    main(["train", "-m", "precision=fp16", "scaler.growth_interval=100,500,2000", *FAST,
          f"hydra.sweep.dir={sweep_dir}"])
    jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert len(jobs) == 3
    for num, (job, interval) in enumerate(zip(jobs, (100, 500, 2000))):
        assert job.name.startswith(f"{num}_") and f"scaler.growth_interval={interval}" in job.name
    for job, interval in zip(jobs, (100, 500, 2000)):
        assert len(rows(job)) == 6
        config = (job / ".hydra" / "config.yaml").read_text()
        assert f"growth_interval: {interval}" in config
    # the same sweep dir again: its jobs would land beside (or in) these; refused before anything is written
    before = {p: p.read_bytes() for p in sweep_dir.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "-m", "precision=fp16", "scaler.growth_interval=100,500", *FAST, f"hydra.sweep.dir={sweep_dir}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"ampctl train: error: hydra.sweep.dir={sweep_dir} already holds a sweep (3 "
                                       "job directories with records): continue it with resume=auto, or choose another "
                                       "hydra.sweep.dir\n")
    assert {p: p.read_bytes() for p in sweep_dir.rglob("*") if p.is_file()} == before


def test_cfg_job_prints_the_config_without_training(tmp_path, restore_argv, capsys):
    main(["train", "--cfg", "job", "precision=O2", f"hydra.run.dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert "name: O2" in out and "master_weights: true" in out and "init_scale: 65536.0" in out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["precision=fp61"], f"precision=fp61: no such precision (did you mean fp16?); choose one of "
                             f"{', '.join(PRECISION_MODES)}"),
        (["precision=fp16", "scaler.growth_factor=1"], "scaler.growth_factor=1.0 is not allowed"),
        (["precision=fp16", "scaler.backoff_factor=1.5"], "scaler.backoff_factor=1.5 is not allowed"),
        (["precision=fp16", "scaler.growth_interval=0"], "scaler.growth_interval=0 is not allowed"),
        (["precision=fp16", "scaler.init_scale=0"], "scaler.init_scale=0.0 is not allowed"),
        (["train.steps=0"], "train.steps=0 is not allowed"),
        (["train.steps=abc"], "train.steps='abc' is not allowed: expected an integer"),
        (["device=tpu"], "device='tpu' is not allowed: expected one of auto, cpu, cuda"),
        (["scaler.growth_interval=5"], "scaler.growth_interval: no such key"),
        (["recipe.corpus=/no/such/file"], "recipe.corpus='/no/such/file' does not exist"),
        (["precision=fp16", "scaler.growth_interval=100,500"], "add --multirun"),
        # optimizer arguments, named by key (before: a traceback, or blamed on fused)
        (["optimizer.betas=[0.9]"], "optimizer.betas=[0.9] is not allowed: expected two numbers in [0, 1)"),
        (["optimizer.weight_decay=-5"], "optimizer.weight_decay=-5 is not allowed: expected a finite number >= 0"),
        (["optimizer=sgd", "optimizer.momentum=-1"], "optimizer.momentum=-1 is not allowed"),
        (["optimizer.eps=0"], "optimizer.eps=0 is not allowed: expected a finite number > 0"),
        # numbers no field can hold
        (["train.steps=99999999999999999999"], "train.steps=99999999999999999999 is not allowed: expected an integer "
                                               "that fits in 64 bits (|x| < 2^63)"),
        (["train.seed=99999999999999999999"], "train.seed=99999999999999999999 is not allowed"),
        (["precision=fp16", "scaler.init_scale=1e40"], "scaler.init_scale=1e+40 is not allowed"),
        (["precision=fp16", "scaler.max_scale=1e39"], "scaler.max_scale=1e+39 is not allowed"),
        (["recipe=mlp", "device=cpu", "recipe.batch_size=100000000000"],
         "CPU out of memory: tried to allocate 23.28 TiB (recipe.batch_size=100000000000): lower recipe.batch_size"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, restore_argv, capsys, args, message):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *args, f"hydra.run.dir={run_dir}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not run_dir.exists()


def test_an_optimizer_argument_torch_refuses_is_one_line(tmp_path, restore_argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "recipe=mlp", "device=cpu", "optimizer=sgd", "optimizer.nesterov=true", "optimizer.momentum=0",
              f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("ampctl train: error: optimizer (torch.optim.SGD) refused its arguments: "
                                       "Nesterov momentum requires a momentum and zero dampening\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("file,text,message", [
    ("recipe/bad.yaml", "_target_: ampctl.recipes.mlp.MLPRecipe\nhidden: [32\nbatch_size: 8\n",
     "recipe/bad.yaml, line 3, column 11: expected ',' or ']', but got ':' (while parsing a flow sequence from "
     "line 2, column 9)"),
    ("mine.yaml", "defaults:\n  - train\n  - _self_\ntrain:\n\tsteps: 3\n",
     "mine.yaml, line 5, column 1: found character '\\t' that cannot start any token"),
])
def test_malformed_yaml_under_cd_is_one_line_with_file_line_and_column(tmp_path, restore_argv, capsys, file, text,
                                                                        message):
    conf = tmp_path / "conf"
    (conf / file).parent.mkdir(parents=True, exist_ok=True)
    (conf / file).write_text(text)
    args = ["recipe=bad"] if file.startswith("recipe/") else ["-cn", "mine"]
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "-cd", str(conf), *args, f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert err.startswith(f"ampctl train: error: malformed YAML in {conf}/"), err
    assert not (tmp_path / "run").exists()


def test_inspect_steps_no_field_can_hold_is_one_line(tmp_path, restore_argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "recipe=mlp", "inspect.steps=99999999999999999999", f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("ampctl inspect: error: inspect.steps=99999999999999999999 is not allowed: "
                                       "expected an integer that fits in 64 bits (|x| < 2^63)\n")
    assert not (tmp_path / "run").exists()


def test_unknown_command_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["trian"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown command 'trian'; did you mean 'train'? choose one of: {', '.join(COMMANDS)}" in err
    assert ", ".join(COMMANDS) == "train, advise, compare, diff, inspect, memory, export, report, init, list"


# --- real processes ---------------------------------------------------------------------------------


def test_console_script_help_and_list():
    result = ampctl("--help")
    assert result.returncode == 0 and "train" in result.stdout and "list" in result.stdout
    result = ampctl("list")
    assert result.returncode == 0
    for name in ("fp32", "tf32", "fp16", "bf16", "O1", "O2", "O3", "dynamic", "static", "mlp", "gpt", "resnet"):
        assert name in result.stdout


@pytest.mark.slow
def test_list_remeasure_measures_the_cpu_into_a_fresh_cache_and_every_line_agrees_with_it(tmp_path):
    """The bottom lines are the probe's figures; the table's "runs here" column and a run's start warning say the
    same of each half type (one set of figures), and a CPU with the instructions is never said to lack them."""
    from ampctl.analysis import cpu_figures, cpu_speed
    from ampctl.engine import devices

    env = {"XDG_CACHE_HOME": str(tmp_path), "COLUMNS": "400"}  # one table row a line
    result = ampctl("list", "--remeasure", "device=cpu", env=env)
    assert result.returncode == 0, result.stderr
    cached = json.loads((tmp_path / "ampctl" / "cpu_speed.json").read_text())
    (figures,) = cached.values()
    speed = cpu_figures.CpuSpeed.from_json(figures)
    if os.environ.get(cpu_speed.ASSUME_ENV):  # the suite run as on another kind of CPU: what ampctl says is its
        speed = cpu_speed.assumed(os.environ[cpu_speed.ASSUME_ENV], speed)
    out = " ".join(result.stdout.split())
    for line in speed.describe():
        assert " ".join(line.split()) in out
    for dtype, mode in (("bfloat16", "bf16"), ("float16", "fp16")):
        why = speed.why_slow(dtype)
        run = ampctl("train", "recipe=mlp", f"precision={mode}", "train.steps=1", "device=cpu", "train.console=plain",
                     f"hydra.run.dir={tmp_path / mode}", env=env)
        assert run.returncode == 0, run.stderr
        warned = [line for line in run.stdout.splitlines() if "expect it to run many times slower than fp32" in line]
        assert (warned and why in warned[0]) if why else not warned
        (row,) = [line for line in result.stdout.splitlines() if line.startswith(f"│ {mode} ")]
        assert ("yes, slowly" in row) == (why is not None) and (why is None or why in row)
        for flag, label in devices.HALF_INSTRUCTIONS[dtype].items():
            assert (f"{label}: yes" in out or f"{label} and" in out) if flag in speed.flags else True
            assert not (flag in speed.flags and f"no {label}" in out)


def test_train_help_lists_the_config_groups():
    result = ampctl("train", "--help")
    assert result.returncode == 0
    optimizers = "adafactor, adam, adam8bit, adamw, adamw_4bit, adamw_8bit, adamw_bf16_sr, adamw_fp8, sgd"
    for text in (f"precision: {', '.join(PRECISION_MODES)}", "scaler: dynamic, none, static",
                 "recipe:", f"optimizer: {optimizers}"):
        assert text in result.stdout, result.stdout


def test_a_bad_config_in_a_real_process_has_no_traceback(tmp_path):
    result = ampctl("train", "precision=fp16", "scaler.backoff_factor=2", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "ampctl train: error: scaler.backoff_factor=2.0 is not allowed: expected a number in (0, 1)"
    ]
    assert not (tmp_path / "outputs").exists()


def test_a_real_run_in_a_pipe_prints_plain_lines(tmp_path):
    result = ampctl("train", "precision=bf16", *FAST[:-1], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Selected precision=bf16")
    # the first step prints at once, then every log step; each line with the time left
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(" |")[0] for line in steps] == ["step 1/6", "step 3/6", "step 6/6"]
    assert all(re.search(r" \| eta \d+:\d\d:\d\d$", line) for line in steps) and steps[-1].endswith("eta 0:00:00")
    [run_dir] = list((tmp_path / "outputs").glob("*/*_bf16"))
    assert len(rows(run_dir)) == 6 and (run_dir / "summary.json").is_file()


@pytest.mark.parametrize("command", [["list"], ["--help"]])
def test_a_reader_that_stops_early_is_not_an_error(command):
    """`ampctl list | head -1`: the pipe closes under ampctl (rich's own handling included); exit 0, no traceback."""
    process = subprocess.Popen([sys.executable, "-m", "ampctl", *command], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=REPO)
    assert process.stdout.readline()
    process.stdout.close()
    assert (process.wait(timeout=300), process.stderr.read()) == (0, b"")


def test_a_failure_with_stdout_sent_to_dev_null_still_fails(tmp_path):
    """Exit code 1 with stdout on /dev/null from the start is a real failure, not a closed pipe."""
    (tmp_path / "error.txt").write_text("ValueError: the job failed\n")  # a failed multirun job's record
    with open(os.devnull, "w") as devnull:
        result = subprocess.run([sys.executable, "-m", "ampctl", "report", str(tmp_path)], stdout=devnull,
                                stderr=subprocess.PIPE, text=True, timeout=300)
    assert result.returncode == 1, result.stderr


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_help(command, capsys, restore_argv):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
        raise SystemExit(0)  # Hydra's --help returns; argparse's exits
    out = capsys.readouterr().out
    assert exit_info.value.code in (0, None) and f"ampctl {command}" in out and "error" not in out.lower()


def test_list_shows_the_users_own_options_and_experiment_configs(tmp_path, capsys, restore_argv):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "tinymlp.yaml").write_text("# My tiny MLP. Half the width.\ndefaults:\n  - mlp\n"
                                                     "  - _self_\nhidden: 16\n")
    (tmp_path / "fp16_sweep.yaml").write_text("# The base of my [fp16] sweeps.\ndefaults:\n  - train\n  - _self_\n")
    main(["list", "-cd", str(tmp_path), "device=cpu"])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long cells
    assert "tinymlp │ My tiny MLP." in out and "gpt │" in out  # the user's recipe among the built-in ones
    assert f"ampctl train -cd {tmp_path} -cn NAME" in out and "fp16_sweep │ The base of my [fp16] sweeps." in out
    assert "logger options" in out and "tensorboard" in out
    # the demonstration recipes, in a table of their own after the others (conf/recipe/*.yaml: "Demonstration: ...")
    recipes, demonstrations = out.split("recipe options")[1].split("demonstration recipes: built to fail one known way")
    assert all(f"{name} │" in demonstrations and f"{name} │" not in recipes
               for name in ("exploding", "fragile", "loss_spike", "rounding_spike"))
    assert "exploding │ A layer ('amplifier')" in demonstrations and "Demonstration:" not in out


@pytest.mark.parametrize("args,message", [
    (["devcie=cpu"], "ampctl list: error: unexpected argument 'devcie=cpu': ampctl list takes device=auto|cpu|cuda"),
    (["-cd", "/no/such/dir"], "ampctl list: error: -cd '/no/such/dir' is not a directory"),
])
def test_list_refuses_a_bad_argument_in_one_line(args, message, capsys, restore_argv):
    with pytest.raises(SystemExit) as exit_info:
        main(["list", *args])
    assert exit_info.value.code == 2 and capsys.readouterr().err == message + "\n"


def test_init_writes_an_experiment_that_trains_as_written_from_anywhere(tmp_path, capsys, restore_argv):
    """`ampctl init NAME --dir DIR`, then `ampctl train -cd DIR -cn NAME` from another directory: the recipe
    module beside the configs is importable without PYTHONPATH. A second init refuses to overwrite."""
    exp = tmp_path / "exp"
    main(["init", "my_exp", "--dir", str(exp)])
    assert capsys.readouterr().out.splitlines()[-1] == f"run it: ampctl train -cd {exp} -cn my_exp"
    assert sorted(p.relative_to(exp).as_posix() for p in exp.rglob("*") if p.is_file()) == [
        "my_exp.yaml", "my_exp_recipe.py", "recipe/my_exp.yaml"]
    before = {p: p.read_text() for p in exp.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_info:
        main(["init", "my_exp", "--dir", str(exp)])
    assert exit_info.value.code == 2 and "exists already" in capsys.readouterr().err
    assert {p: p.read_text() for p in exp.rglob("*") if p.is_file()} == before
    result = run_ampctl("train", "-cd", str(exp), "-cn", "my_exp", "device=cpu", "train.steps=12",
                        "train.eval.every=6", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["final_loss"] < rows(tmp_path / "run")[0]["loss"]  # it learns
    evaluations = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evaluations] == [6, 12] and evaluations[1]["eval/loss"] < evaluations[0]["eval/loss"]



@pytest.fixture(scope="module")
def a_fresh_run(tmp_path_factory) -> dict:
    tmp_path = tmp_path_factory.mktemp("fresh")
    return imported_after(["train", *FAST, "train.steps=1", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)


def test_a_training_run_that_draws_nothing_never_imports_matplotlib(a_fresh_run):
    """matplotlib costs ~2 s of start-up: only a command that draws a chart imports it."""
    assert a_fresh_run["torch"] and not a_fresh_run["matplotlib"]


def test_a_fresh_process_freezes_its_start_once_its_run_is_planned(a_fresh_run, tmp_path, restore_argv, capsys):
    """processes.start_kept_out_of_collections: the collector is off while a fresh `ampctl` imports and plans its
    run, then what that made (torch's ~200,000 objects and more) is frozen, out of every later collection, and the
    collector is on again. A refused command freezes nothing; a process that imported torch before (this one) is
    left as it was."""
    assert a_fresh_run["frozen"] > 100_000 and a_fresh_run["collecting"]
    refused = imported_after(["train", "precision=bf61"], tmp_path, exit_code=2)
    assert refused["frozen"] == 0 and refused["collecting"] and not refused["torch"]
    import gc

    frozen_here = gc.get_freeze_count()
    main(["train", *FAST, "train.steps=1", f"hydra.run.dir={tmp_path / 'run'}"])
    assert gc.get_freeze_count() == frozen_here and gc.isenabled()


def imported_after(args: list[str], cwd: Path, env: Optional[dict] = None, exit_code: int = 0) -> dict:
    """Which of torch, Dynamo and matplotlib a fresh process of `ampctl <args>` imported, how many objects its
    garbage collector holds frozen (gc.freeze) and whether it collects, as the command left them."""
    code = ("import gc, sys; from ampctl.cli import main\n"
            "try:\n"
            f"    main({args!r})\n"
            "except SystemExit as exc:\n"
            f"    assert (exc.code or 0) == {exit_code}, exc.code\n"
            "print({**{m: m in sys.modules for m in ('torch', 'torch._dynamo', 'matplotlib')}, "
            "'frozen': gc.get_freeze_count(), 'collecting': gc.isenabled()})")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_and_completion_answer_without_importing_torch(tmp_path, command):
    """`ampctl train --help` and every Tab of shell completion: ~1 s here, where importing torch alone is 1.5 s
    (benchmarks/startup.py measures them); `ampctl report --help` took 7 s on a busy machine."""
    assert not imported_after([command, "--help"], tmp_path)["torch"]
    completion = imported_after(["-sc", "query=bash"], tmp_path, {"COMP_LINE": f"ampctl {command} precision=f"})
    assert not completion["torch"]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_after_a_commands_arguments_is_its_help(tmp_path, command):
    """`ampctl report RUN --help` said `expected one PATH ..., got 2 arguments` (exit 2): --help is help wherever
    it stands, as argparse and Hydra take it."""
    result = ampctl(command, "recipe=mlp", "--help", cwd=tmp_path)
    assert result.returncode == 0 and "error" not in result.stdout + result.stderr, result.stderr
    assert f"ampctl {command}" in result.stdout and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("source,shape", [
    ("gpt2", ["recipe.n_layers=2", "recipe.d_model=64", "recipe.n_heads=2", "recipe.block_size=32",
              "recipe.batch_size=4", "recipe.max_corpus_bytes=200000"]),
    ("mlp", ["recipe.hidden=32"]),
])
def test_init_from_a_built_in_recipe_copies_it_to_run_as_the_original_does(tmp_path, source, shape):
    """`ampctl init NAME --from RECIPE` (torchtune's `tune cp`): the built-in's source and composed config under
    the new name; run as written, the copy trains exactly as the built-in does (same losses on the CPU), and its
    FLOPs, counted by the counter now (the model may have been edited), equal the built-in's formula."""
    exp = tmp_path / "exp"
    made = run_ampctl("init", "mine", "--from", source, "--dir", str(exp), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    source_module = {"gpt2": "gpt", "mlp": "mlp"}[source]
    copied = (exp / "mine_recipe.py").read_text()
    assert copied.endswith((REPO / "ampctl" / "recipes" / f"{source_module}.py").read_text())
    common = ["device=cpu", "train.steps=4", "train.console=quiet", "telemetry.profile_cpu_memory=false", *shape]
    for args, run in ((["-cd", str(exp), "-cn", "mine"], "copy"), ([f"recipe={source}"], "built_in")):
        result = run_ampctl("train", *args, *common, f"hydra.run.dir={tmp_path / run}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    assert [r["loss"] for r in rows(tmp_path / "copy")] == [r["loss"] for r in rows(tmp_path / "built_in")]
    copy, built_in = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("copy", "built_in"))
    assert copy["model_flops_source"].startswith("torch.utils.flop_counter")
    assert built_in["model_flops_source"].startswith(f"{source_module}_flops")
    assert copy["model_flops_per_step"] == built_in["model_flops_per_step"]
    refused = run_ampctl("init", "other", "--from", "gtp", "--dir", str(exp), cwd=tmp_path)
    assert refused.returncode == 2 and "--from gtp: no such built-in recipe (did you mean gpt?)" in refused.stderr


def test_ampctl_without_a_command_prints_its_usage_on_stderr_and_exits_2(tmp_path):
    """As argparse and git do; `ampctl --help` is the usage asked for (stdout, exit 0)."""
    bare = run_ampctl(cwd=tmp_path)
    assert bare.returncode == 2 and bare.stdout == "" and bare.stderr.startswith("usage: ampctl <command>")
    assert "commands:" in bare.stderr and "  train " in bare.stderr
    asked = run_ampctl("--help", cwd=tmp_path)
    assert asked.returncode == 0 and asked.stdout.startswith("usage: ampctl <command>") and asked.stderr == ""


def test_report_of_a_directory_that_is_no_sweep_writes_nothing_into_it(tmp_path):
    """A folder of the user's holding runs (outputs/, /tmp): its table on the screen, no file written there (its own
    report.md stays theirs); a multirun directory gets its files as ever."""
    folder = tmp_path / "mine"
    assert run_ampctl("train", "recipe=mlp", "recipe.hidden=16", "train.steps=2", "device=cpu", "train.console=quiet",
                      f"hydra.run.dir={folder / 'a'}", cwd=tmp_path).returncode == 0
    (folder / "report.md").write_text("my notes\n")
    shown = run_ampctl("report", str(folder), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"nothing written in {folder}: it holds runs but is no multirun directory" in " ".join(shown.stdout.split())
    assert sorted(p.name for p in folder.iterdir()) == ["a", "report.md"]
    assert (folder / "report.md").read_text() == "my notes\n"
    helped = run_ampctl("report", "--help", cwd=tmp_path)
    assert "a run, multirun, advise, compare, diff, inspect or memory directory" in helped.stdout
