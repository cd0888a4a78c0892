"""What a Hydra user relies on, through `ampctl <command>` as a user types it: shell completion (bash calling the
installed script), a primary config of their own (-cd/-cn), sweeper plugins, `--cfg job` loaded back, and `+key`
typos refused. Each failed before ampctl stopped re-implementing Hydra's composition (issue 12). The commands run
in this process (tests/support/in_process.py): what Hydra composes is under test here, not the process; the
console script's own start is tested in test_cli.py."""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.in_process import run_ampctl

BIN = Path(sys.executable).parent  # the environment's `ampctl` script, as the README's install puts it
QUICK = ["recipe=mlp", "recipe.hidden=32", "train.steps=2", "device=cpu", "train.console=quiet",
         "telemetry.profile_cpu_memory=false"]


def ampctl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_ampctl(*args, cwd=cwd)


def summaries(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.rglob("summary.json"))]


pytestmark = pytest.mark.skipif(not (BIN / "ampctl").is_file(), reason="needs ampctl installed (pip install -e .)")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completion_installs_for_ampctl_and_completes_a_commands_config(tmp_path):
    script = ampctl("train", "--shell-completion", "install=bash", cwd=tmp_path)
    assert script.returncode == 0, script.stderr
    assert script.stdout.rstrip().endswith("-F hydra_bash_completion ampctl")  # not `ampctl-train`
    (tmp_path / "completion.sh").write_text(script.stdout)

    def complete(line: str) -> list[str]:
        """What bash offers for TAB at the end of `line`, through the installed completion function."""
        words = line.split() + ([""] if line.endswith(" ") else [])
        probe = (f'source completion.sh; COMP_LINE="{line}"; COMP_POINT={len(line)}; '
                 f'COMP_WORDS=({" ".join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}; '
                 'hydra_bash_completion; printf "%s\\n" "${COMPREPLY[@]}"')
        result = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                                env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})
        assert result.returncode == 0 and not result.stderr, result.stderr
        assert "error" not in result.stdout, result.stdout  # a command's refusal of the query, offered as words
        return result.stdout.split()

    assert "precision=" in complete("ampctl train prec")
    assert {"precision=bf16", "precision=fp8_emulated", "precision=O2"} <= set(complete("ampctl train precision="))
    assert "scaler.growth_interval=" in complete("ampctl train scaler=dynamic scaler.gro")
    assert complete("ampctl tr") == ["train"]
    assert "memory.budget=" in complete("ampctl memory memory.bu")  # each command completes its own config
    # a list-typed key is set whole (Hydra offered `compare.precisions.`, a dot leading nowhere for a null list)
    assert complete("ampctl compare compare.prec") == ["compare.precisions="]
    assert "memory.precisions=" in complete("ampctl memory memory.pre")
    assert "advise.budget=" in complete("ampctl advise advise.bu")
    assert "inspect.steps=" in complete("ampctl inspect inspect.st")
    # a value that is one of a few: an Enum's by their values (Hydra offered `guard.on_trip=TripAction.stop`), a
    # key whose schema names its choices (diff.against: a precision mode; torch.compile's modes)
    assert complete("ampctl train guard.on_trip=") == ["guard.on_trip=stop", "guard.on_trip=escalate"]
    assert complete("ampctl train train.console=p") == ["train.console=plain"]
    assert complete("ampctl train guard.on_nonfinite=") == ["guard.on_nonfinite=stop", "guard.on_nonfinite=warn"]
    assert {"diff.against=fp32", "diff.against=bf16", "diff.against=O2"} <= set(complete("ampctl diff diff.against="))
    assert complete("ampctl diff diff.against=bf") == ["diff.against=bf16", "diff.against=bf16_true"]
    assert "train.compile.mode=max-autotune" in complete("ampctl train train.compile.mode=")
    # the commands that are not Hydra apps complete their own arguments (they refused the query as an argument)
    (tmp_path / "run").mkdir()
    assert "export.dtype=" in complete("ampctl export run export.")
    assert set(complete("ampctl export run export.dtype=")) == {"export.dtype=float32", "export.dtype=bfloat16",
                                                                "export.dtype=float16"}
    assert complete("ampctl export ru") == ["run/"] or complete("ampctl export ru") == ["run"]  # PATH: file names
    assert complete("ampctl init x --fr") == ["--from"]
    assert "mlp" in complete("ampctl init x --from ")
    assert complete("ampctl report ru") in (["run"], ["run/"])
    assert "device=cpu" in complete("ampctl list dev")


def test_a_users_own_primary_config_extends_ampctls_train(tmp_path):
    (tmp_path / "my_conf").mkdir()
    (tmp_path / "my_conf" / "my_experiment.yaml").write_text(
        "defaults:\n  - train\n  - override recipe: mlp\n  - _self_\n\n"
        "recipe:\n  hidden: 32\ntrain:\n  steps: 3\n  seed: 7\n")
    args = ["-cd", "my_conf", "-cn", "my_experiment", "device=cpu", "train.console=quiet",
            "telemetry.profile_cpu_memory=false", "hydra.run.dir=run"]
    result = ampctl("train", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    [summary] = summaries(tmp_path / "run")
    assert (summary["recipe"], summary["steps"]) == ("mlp", 3)
    config = yaml.safe_load((tmp_path / "run" / ".hydra" / "config.yaml").read_text())
    assert config["train"]["seed"] == 7 and config["recipe"]["hidden"] == 32
    # the checks hold there too: a bad value in the user's config is one line, exit 2, no run directory
    bad = ampctl("train", *args[:-1], "train.steps=0", "hydra.run.dir=bad", cwd=tmp_path)
    assert (bad.returncode, bad.stderr) == (2, "ampctl train: error: train.steps=0 is not allowed: "
                                                "expected an integer >= 1\n")
    assert not (tmp_path / "bad").exists()


def test_cfg_job_output_loads_back_as_a_primary_config(tmp_path):
    dumped = ampctl("train", *QUICK, "precision=bf16", "train.seed=3", "--cfg", "job", cwd=tmp_path)
    assert dumped.returncode == 0, dumped.stderr
    (tmp_path / "x.yaml").write_text(dumped.stdout)
    again = ampctl("train", "-cd", ".", "-cn", "x", "--cfg", "job", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    reloaded = yaml.safe_load(again.stdout)  # loaded with -cd ., it names that directory in Hydra's search path
    assert reloaded.pop("hydra") == {"searchpath": [f"file://{tmp_path.resolve()}"]}
    assert reloaded == yaml.safe_load(dumped.stdout)
    assert dumped.stdout.startswith("# ampctl's composed train config")
    assert "  - override precision: bf16\n" in dumped.stdout
    trained = ampctl("train", "-cd", ".", "-cn", "x", "train.steps=1", "train.console=plain", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    [run] = (tmp_path / "outputs").glob("*/*")
    assert run.name.endswith("_bf16")  # named as a run of ampctl's train config, with its mode
    [summary] = summaries(run)
    assert (summary["precision"], summary["steps"], summary["recipe"]) == ("bf16", 1, "mlp")
    lines = trained.stdout.splitlines()
    assert len(lines) == len(set(lines)) and not any("][ampctl" in line for line in lines)  # each said once
    # the loaded config is typed by ampctl's schema as the composed one was
    bad = ampctl("train", "-cd", ".", "-cn", "x", "scaler.kind=sometimes", "hydra.run.dir=bad", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("ampctl train: error: scaler.kind='sometimes'")


@pytest.mark.parametrize("multirun", [False, True])
def test_a_key_added_with_plus_is_refused_like_any_unknown_key(tmp_path, multirun):
    sweep = ["-m", "train.seed=1,2"] if multirun else []
    result = ampctl("train", *sweep, *QUICK, "+train.stepz=5", "hydra.run.dir=run", "hydra.sweep.dir=sweep",
                    cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("ampctl train: error: train.stepz: no such key (did you mean train.steps?); "
                                    "allowed: steps, ")
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()


def test_a_bad_value_in_any_job_of_a_sweep_stops_it_before_the_first(tmp_path):
    result = ampctl("train", "-m", *QUICK, "precision=fp16", "scaler.growth_factor=2,0.5", "hydra.sweep.dir=sweep",
                    cwd=tmp_path)
    assert (result.returncode, result.stderr) == (2, "ampctl train: error: scaler.growth_factor=0.5 is not "
                                                     "allowed: expected a finite number > 1\n")
    assert not (tmp_path / "sweep").exists()


def plugin_installed(module: str) -> bool:
    """find_spec of a dotted name raises where its parent package is missing (no Hydra plugin at all)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def test_a_missing_sweeper_or_launcher_plugin_names_its_package(tmp_path):
    if plugin_installed("hydra_plugins.hydra_joblib_launcher"):
        pytest.skip("hydra-joblib-launcher is installed here")
    result = ampctl("train", "-m", *QUICK, "hydra/launcher=joblib", "train.seed=1,2", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("ampctl train: error: hydra/launcher=joblib: the launcher plugin is not "
                                    "installed; pip install hydra-joblib-launcher (installed: basic")


@pytest.mark.skipif(not plugin_installed("hydra_plugins.hydra_optuna_sweeper"),
                    reason="hydra-optuna-sweeper is installed by [dev]")
def test_a_sweeper_plugin_chooses_the_jobs(tmp_path):
    result = ampctl("train", "-m", *QUICK, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3",
                    "hydra.sweeper.sampler.seed=0", "optimizer.lr=interval(1e-4,1e-2)", "hydra.sweep.dir=sweep",
                    cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Best parameters: {'optimizer.lr':" in result.stderr + result.stdout
    configs = sorted((tmp_path / "sweep").glob("*/.hydra/config.yaml"))
    lrs = [yaml.safe_load(p.read_text())["optimizer"]["lr"] for p in configs]
    assert len(lrs) == 3 and len(set(lrs)) == 3 and all(1e-4 <= lr <= 1e-2 for lr in lrs)
    assert (tmp_path / "sweep" / "sweep.csv").is_file()  # ampctl's sweep table, as after the basic sweeper


def test_a_sweep_with_a_path_among_its_overrides_keeps_each_job_in_a_directory_of_its_own(tmp_path):
    """A value with a `/` (a data root, a mirror URL) went into Hydra's override_dirname as it is: each job was a
    directory nested under others, and the sweep's table was empty. Each job mirrors to its own URL (a mirror holds
    one run) through Hydra's ${hydra:job.num}."""
    import fsspec

    mirror = f"memory://sweep-{id(tmp_path)}"
    result = ampctl("train", "-m", *QUICK, f"train.checkpoint.mirror={mirror}/${{hydra:job.num}}",
                    "optimizer.lr=0.001,0.002", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # Hydra's basic launcher's "Launching 2 jobs locally" and "#0 : overrides": ampctl's sweep line says each job
    assert "[HYDRA]" not in result.stdout and "ampctl sweep: job #1 (2 of 2: " in result.stdout + result.stderr
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert [name[:2] for name in jobs] == ["0_", "1_"] and all("/" not in name for name in jobs), jobs
    assert [row["status"] for row in json.loads((tmp_path / "sweep" / "sweep.json").read_text())["rows"]] == \
        ["ok", "ok"]
    fs = fsspec.filesystem("memory")
    assert all(fs.exists(f"{mirror}/{job}/identity.json") for job in (0, 1))
    fs.rm(mirror.split("://")[1], recursive=True)


def test_an_experiment_group_of_ones_own_is_chosen_with_plus(tmp_path):
    """docs/sweeps.md's experiment pattern: a group in a -cd directory, `# @package _global_`, group overrides."""
    group = tmp_path / "my_conf" / "experiment"
    group.mkdir(parents=True)
    (group / "fp16_short.yaml").write_text("# @package _global_\ndefaults:\n  - override /precision: fp16\n"
                                           "  - override /recipe: mlp\n\ntrain:\n  steps: 3\nscaler:\n"
                                           "  growth_interval: 100\n")
    result = ampctl("train", "-cd", "my_conf", "+experiment=fp16_short", "device=cpu", "hydra.run.dir=run",
                    cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load((tmp_path / "run" / ".hydra" / "config.yaml").read_text())
    assert config["precision"]["name"] == "fp16" and config["recipe"]["_target_"].endswith("MLPRecipe")
    assert config["train"]["steps"] == 3 and config["scaler"]["growth_interval"] == 100


def test_the_private_composition_agrees_with_hydras_own_app(tmp_path):
    """shell/hydra_internals.py composes outside a Hydra app (the Python API, `ampctl list`) through Hydra's
    private classes, for the one thing the public compose API lacks: a `-cd` directory ahead of ampctl's configs.
    Pinned against Hydra's own app on this Hydra version: the composed job is the one `ampctl train -cd DIR --cfg
    job` prints, with a user's precision/bf16.yaml beside ampctl's (Hydra's app keeps ampctl's: a `-cd` directory
    comes after the app's own configs) and a mode of their own."""
    from omegaconf import OmegaConf

    from ampctl.conf.composing import without_hydra_node
    from ampctl.shell.hydra_internals import composed

    conf = tmp_path / "conf"
    (conf / "precision").mkdir(parents=True)
    ampctls = (importlib.resources.files("ampctl.conf") / "precision" / "bf16.yaml").read_text()
    (conf / "precision" / "bf16.yaml").write_text(ampctls.replace("description:", "description: MINE"))
    (conf / "precision" / "mine.yaml").write_text(ampctls.replace("name: bf16", "name: mine"))
    for mode in ("bf16", "mine"):
        args = [*QUICK, f"precision={mode}", "train.seed=5"]
        with composed("train", args, config_dir=conf) as cfg:
            ours = OmegaConf.to_container(without_hydra_node(cfg), enum_to_str=True)
            assert cfg.hydra.runtime.choices.precision == mode
        app = ampctl("train", "-cd", str(conf), *args, "--cfg", "job", cwd=tmp_path)
        assert app.returncode == 0, app.stderr
        printed = yaml.safe_load(app.stdout)
        printed.pop("defaults")  # ampctl's dump names its choices, so that it loads back as a primary config
        assert printed.pop("hydra") == {"searchpath": [f"file://{conf.resolve()}"]}  # and where it came from
        assert ours == printed, mode
        assert ours["precision"]["name"] == mode and not ours["precision"]["description"].startswith("MINE")


def test_hydras_copies_of_its_config_repository_share_the_store_and_read_what_is_stored_after():
    """shell/hydra_internals.share_one_config_store: Hydra deep-copies its config repository for each composition
    and for each group --help lists (hydra._internal.config_repository.CachingConfigRepository), the ConfigStore
    within it too (~20 ms each for ampctl's schemas). The store is not copied; a copy made before a config was
    stored still finds it, as a repository reading the store itself does (Hydra's pull request 2928); and what the
    store gives out is a copy, so that sharing it shares nothing a composition changes."""
    import copy

    from hydra._internal.config_repository import CachingConfigRepository, ConfigRepository
    from hydra.core.config_store import ConfigStore

    from ampctl.shell.hydra_internals import config_loader, register_schemas

    register_schemas()
    store = ConfigStore.instance()
    assert copy.deepcopy(store) is store
    repository = CachingConfigRepository(ConfigRepository(config_loader(None).config_search_path))
    store.store(name="stored_after_the_copy", node={"answer": 42})
    try:
        found = repository.load_config("stored_after_the_copy")
        assert found is not None and found.config.answer == 42
        found.config.answer = 0  # a composition's change to what it loaded
        assert store.load("stored_after_the_copy.yaml").node.answer == 42
        assert store.load("stored_after_the_copy.yaml").node is not store.load("stored_after_the_copy.yaml").node
    finally:
        del store.repo["stored_after_the_copy.yaml"]


def test_a_users_config_that_sets_hydra_mode_sweeps_without_m(tmp_path):
    """A config of the user's may choose a sweep itself (hydra.mode: MULTIRUN), as Hydra's own apps allow."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "my_sweep.yaml").write_text("defaults:\n  - train\n  - _self_\n\nhydra:\n  mode: MULTIRUN\n  sweeper:\n"
                                        "    params:\n      train.seed: 1,2\n")
    result = ampctl("train", "-cd", str(conf), "-cn", "my_sweep", *QUICK, "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(summaries(tmp_path / "sweep")) == 2
    seeds = [yaml.safe_load(p.read_text())["train"]["seed"] for p in (tmp_path / "sweep").glob("*/.hydra/config.yaml")]
    assert sorted(seeds) == [1, 2]


def test_ampctls_reading_of_a_command_line_is_hydras_parser():
    """shell/hydra_internals.hydra_flags reads a Hydra app's flags before Hydra does (the router, -cd's modules,
    completion of a half-typed line, a sweep's resume) with a tolerant table rather than Hydra's parser, which
    exits on a half-typed line: the table is pinned to the parser of the Hydra in use, every flag and whether it
    takes a value, and a line Hydra parses reads the same through both."""
    from hydra._internal.utils import get_args_parser

    from ampctl.shell import hydra_internals

    parser = get_args_parser()
    takes_value = {option: action.dest for action in parser._actions for option in action.option_strings
                   if action.nargs != 0}
    takes_none = {option: action.dest for action in parser._actions for option in action.option_strings
                  if action.nargs == 0}
    # ampctl's reading of -sc: its value is the completion's request (install=bash, query=...), which Hydra's parser
    # reads as an override beside a bare flag; and Hydra's experimental_rerun is named rerun
    ours_with_value = {**hydra_internals._FLAGS_WITH_VALUE}
    assert ours_with_value.pop("-sc") == ours_with_value.pop("--shell-completion") == "shell_completion"
    takes_none = {k: v for k, v in takes_none.items() if v != "shell_completion"}
    takes_value["--experimental-rerun"] = "rerun"
    assert ours_with_value == takes_value
    assert hydra_internals._FLAGS == takes_none
    for line in (["-cd", "conf", "precision=bf16", "-m", "scaler.growth_interval=100,200"],
                 ["--config-name=mine", "--cfg", "job", "train.steps=3"], ["-p", "train", "-c", "all", "--resolve"],
                 ["train.steps=3", "--info", "searchpath"], ["-cp=pkg", "-cn", "x", "--multirun", "a=1", "-r"]):
        flags, overrides = hydra_internals.hydra_flags(line)
        parsed = vars(parser.parse_intermixed_args(line))
        assert overrides == parsed.pop("overrides")
        given = {dest: value for dest, value in parsed.items() if value not in (None, False)}
        assert {dest: (True if value is None else value) for dest, value in flags.items()} == given
