"""Bad values, broken inputs and broken installs are one line naming the bad value and what is allowed, exit 2, no
traceback, nothing left behind. (The adversarial suite: real processes where a kill or a signal is the point.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import ampctl
from ampctl.cli import main
from tests.support.adversarial import MLP, REPO, cli, one_line_refusal
from tests.support.runs import snapshot

# --- no tracebacks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,named", [
    (["recipe.hidden=2.5"], "recipe.hidden=2.5 is not allowed: expected an integer"),
    (["recipe.hidden=abc"], "recipe.hidden='abc' is not allowed: expected an integer"),
    (["recipe.batch_size=1e11"], "recipe.batch_size=100000000000.0 is not allowed: expected an integer"),
    (["recipe.norm=batchnorm", "recipe.batch_size=1"], "recipe.batch_size=1 is not allowed"),
    (["+optimizer.foo=1"], "optimizer.foo: torch.optim.AdamW takes no argument 'foo'; it takes lr, betas"),
    (["optimizer._target_=os.getcwd"], "takes no arguments: it must name a torch.optim.Optimizer"),
    (["optimizer.fused=maybe"], "optimizer.fused='maybe' is not allowed: expected true, false or null"),
    (["telemetry.profile_cpu_memory=2"], "telemetry.profile_cpu_memory=2 is not allowed: expected true or false"),
    (["train.steps=${oops}"], "Interpolation key 'oops' not found"),
    (["+experiment=x"], "To choose experiment=x from a config group of your own, put it in DIR/experiment/x.yaml"),
    (["hydra.run.dir=/proc/ampctl-test/run"], "cannot write /proc/ampctl-test"),
    # precision per layer and the microscaling formats (issue 26)
    (["precision=mxfp4", "precision.options.elements=e5m2"],
     "precision.options.elements='e5m2' is not allowed: expected e4m3"),
    (["precision=nvfp4", "precision.options.scale_mode=rceil"], "precision.options.scale_mode='rceil' is not allowed"),
    (["precision=mxfp8", "precision.options.scale_mode=round"], "precision.options.scale_mode"),
    (["precision=bf16", "precision.options.scale_mode=rceil"],
     "precision.options.scale_mode is an option of precision=mxfp4, mxfp8 or nvfp4 only"),
    (["precision=fp8_emulated", "precision.options.marjin=1"],
     "no converter mode has the option precision.options.marjin (did you mean precision.options.margin?)"),
    (["precision.converter=nope"], "precision.converter=nope: no such converter"),
    (["precision.rules=[{match:'9',run_in:fp32}"], "no viable alternative at input"),
    (["precision.rules=[{match:'9',run_in:fp32,extra:1}]"], "precision.rules[].extra: no such key; allowed: run_in, "
                                                            "match, type"),
    (["precision.rules=[{match:'9'}]"], "precision.rules[0].run_in: required, and not given"),
    (["precision.rules={match:'9'}"], "precision.rules: expected a list"),
    (["precision=O2", "precision.keep_norm_fp32=false"], "precision.keep_norm_fp32: replaced by the per-layer rule"),
    # optimizer-state precision (issue 38)
    (["optimizer=adamw_bf16_sr"], "optimizer.bf16_stochastic_round=true rounds the bfloat16 weights the optimizer "
                                  "steps on, and this precision mode steps on fp32 weights"),
    (["optimizer=adamw_4bit", "optimizer.block_size=96"], "optimizer.block_size=96 is not allowed: a power of two"),
    (["optimizer=adamw_8bit", "optimizer.block_size=big"], "optimizer.block_size='big' is not allowed"),
    (["optimizer=adamw_fp8", "+optimizer.fused=true"], "torchao.optim.AdamWFp8 takes no argument 'fused'"),
    (["optimizer=adamw_4bit", "+optimizer.amsgrad=true"], "optimizer.amsgrad=true with torchao.optim.AdamW4bit: "
                                                           "torchao's quantized states cannot keep amsgrad's running"),
    # the fp32 weight average (issue 38)
    (["train.ema.decay=1"], "train.ema.decay=1.0 is not allowed: expected a number in (0, 1)"),
    (["train.ema.decay=0"], "train.ema.decay=0.0 is not allowed"),
    (["train.ema.decay=nan"], "train.ema.decay=nan is not allowed"),
    (["train.ema.decay=fast"], "train.ema.decay='fast' is not allowed"),
    (["train.ema.decay=0.9", "train.ema.every=0"], "train.ema.every=0 is not allowed: expected an integer >= 1"),
    (["train.ema.decay=0.9", "train.ema.start_step=-1"], "train.ema.start_step=-1 is not allowed"),
    (["train.checkpoint.monitor=ema_loss", "train.eval.every=1", "train.checkpoint.save_top_k=1"],
     "train.checkpoint.monitor='ema_loss' is not allowed: expected a metric of the model's without train.ema.decay"),
    (["train.ema.decay=0.9", "train.checkpoint.monitor=ema_nope", "train.checkpoint.monitor_mode=min",
      "train.eval.every=1", "train.checkpoint.save_top_k=1"],
     "train.checkpoint.monitor=ema_nope: the recipe's evaluation gives no such metric; it gives "
                             "accuracy, ema_accuracy, ema_loss, loss"),
    # the loss-spike guard (issue 53)
    (["guard.loss_spike=0"], "guard.loss_spike=0.0 is not allowed: expected a number of robust deviations > 0"),
    (["guard.loss_spike=inf"], "guard.loss_spike=inf is not allowed"),
    (["guard.loss_spike=6", "guard.loss_spike_window=5"],
     "guard.loss_spike_window=5 is not allowed: expected an integer >= 10"),
    # what users of the anchors rely on (issue 54)
    (["precision=O2", "precision.grad_accum_dtype=int8"], "precision.grad_accum_dtype"),
    (["train.checkpoint.mirror=memory://x", "train.checkpoint.mirror_options=5"], "train.checkpoint.mirror_options"),
    (["distributed.checkpoint_format=sharded", "distributed.async_checkpoint=true",
      "distributed.async_checkpointer=process"],
     "distributed.async_checkpointer='process' is not allowed: expected thread without a distributed run"),
    (["distributed.async_checkpointer=fork"], "distributed.async_checkpointer='fork' is not allowed: expected one of "
                                              "thread, process"),
    # sizes torch cannot build or train (issue 35)
    (["recipe.in_features=9223372036854775807"], "its model cannot be built, its tensors are too large to allocate "
     "(Storage size calculation overflowed with sizes=[32, 9223372036854775807]); its largest size option: "
     "recipe.in_features=9223372036854775807"),
])
def test_bad_values_are_one_line_exit_2_and_leave_nothing(tmp_path, args, named):
    refused = cli("train", *MLP, "train.steps=1", f"hydra.run.dir={tmp_path / 'run'}", *args, cwd=tmp_path)
    assert named in one_line_refusal(refused, "train")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args,named", [
    (["diff.noise_share=0"], "diff.noise_share=0.0 is not allowed: expected a share in (0, 1]"),
    (["diff.top=0"], "diff.top=0 is not allowed: expected an integer >= 1"),
    (["diff.repair_layers=0"], "diff.repair_layers=0 is not allowed: expected an integer >= 1"),
    (["diff.budget=forever"], "diff.budget='forever' is not allowed: expected a duration"),
    (["diff.weights=/nonexistent/run"], "diff.weights='/nonexistent/run' does not exist; give a run directory or a "
                                        "checkpoint"),
    (["diff.against=bf16", "precision=bf16"], "precision=bf16 is the reference (diff.against=bf16)"),
])
def test_a_diff_given_bad_values_is_one_line_exit_2_and_leaves_nothing(tmp_path, args, named):
    refused = cli("diff", *MLP, "precision=bf16", "diff.batches=2", f"hydra.run.dir={tmp_path / 'diff'}", *args,
                  cwd=tmp_path)
    assert named in one_line_refusal(refused, "diff")
    assert not (tmp_path / "diff").exists()


@pytest.mark.parametrize("command,named", [
    (["train", "recipe=resnet", "recipe.data=synthetic", "recipe.image_size=1", "recipe.batch_size=1"],
     "recipe.image_size=1 with recipe.batch_size=1: ResNet's last stage would hold one value per channel"),
    (["train", "recipe=timm", "recipe.model=resnet18", "recipe.image_size=32", "recipe.batch_size=1"],
     "a BatchNorm layer got one value per channel (Expected more than 1 value per channel when training"),
    (["inspect", "recipe=timm", "recipe.model=resnet18", "recipe.image_size=32", "recipe.batch_size=1"],
     "a BatchNorm layer got one value per channel"),
])
def test_a_batch_norm_given_one_value_per_channel_is_one_line(tmp_path, command, named):
    refused = cli(*command, "device=cpu", "train.steps=1", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert named in one_line_refusal(refused, command[0])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("damage,named", [
    (lambda run: (shutil.rmtree(run / "checkpoints"), (run / "checkpoints").write_text("x")),
     "checkpoints is a file, where an ampctl run keeps a directory: the run directory is damaged"),
    (lambda run: (run / ".ampctl.lock").mkdir(), ".ampctl.lock is a directory, where an ampctl run keeps a file"),
])
def test_a_run_directory_whose_own_names_are_the_wrong_kind_is_refused_and_left_as_it_is(tmp_path, damage, named):
    """checkpoints/ replaced by a file (it failed in mkdir after setting the rows aside), the lock a directory."""
    run = tmp_path / "run"
    assert cli("train", *MLP, "train.steps=4", "train.checkpoint.every=2", f"hydra.run.dir={run}",
               cwd=tmp_path).returncode == 0
    damage(run)
    before = snapshot(run)
    refused = cli("train", *MLP, "train.steps=6", "resume=auto", f"hydra.run.dir={run}", cwd=tmp_path)
    assert named in one_line_refusal(refused, "train")
    assert snapshot(run) == before and (run / ".ampctl.lock").is_dir() == ("lock" in named)


def test_report_on_a_directory_it_cannot_write_shows_the_report_and_says_so(tmp_path):
    """A finished run in a directory that refuses writes (made immutable: root ignores permission bits): the table
    on the screen, one line naming the file it could not write, exit 74, no traceback."""
    run = tmp_path / "run"
    assert cli("train", *MLP, "train.steps=2", f"hydra.run.dir={run}", cwd=tmp_path).returncode == 0
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(run)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available here")
    else:
        run.chmod(0o555)
    try:
        shown = cli("report", str(run), cwd=tmp_path)
        (run / "train.log").unlink() if os.geteuid() != 0 else None
        resumed = cli("train", *MLP, "train.steps=4", "resume=auto", f"hydra.run.dir={run}", cwd=tmp_path)
    finally:
        subprocess.run(["chattr", "-i", str(run)], capture_output=True) if os.geteuid() == 0 else run.chmod(0o755)
    assert shown.returncode == 74 and "Traceback" not in shown.stderr, shown.stderr
    assert shown.stderr.startswith("ampctl report: error: cannot write ") and shown.stderr.count("\n") == 1
    assert "final_loss" in shown.stdout and not (run / "run.csv").exists()
    # a resume into it: one line naming what could not be written (it said Hydra's "Unable to configure handler")
    assert resumed.returncode == 74 and resumed.stderr.startswith("ampctl train: error: cannot write "), resumed.stderr
    assert resumed.stderr.count("\n") == 1


@pytest.mark.parametrize("command", [
    ["train", "recipe=timm", "train.steps=1"], ["train", "recipe=resnet", "train.steps=1"],
    ["train", "recipe=hf_causal_lm", "recipe.model_type=llama", "train.steps=1"],  # transformers imports it lazily
    ["inspect", "recipe=hf_causal_lm", "recipe.model_type=qwen2", "+recipe.config.num_hidden_layers=2",
     "inspect.steps=1"],  # the README's line: deep in a model class, wrapped in transformers' own error
])
def test_a_torchvision_for_another_torch_is_the_same_one_line_on_every_path(tmp_path, command):
    """As after `pip install '.[models]'` beside a CPU-only torch from PyTorch's index: torchvision's compiled
    operators are missing, which surfaces wherever a library first imports it. Simulated by a torchvision that fails
    the same way, first on the path. The fix it names replaces the installed torchvision even where its version
    number is the right one (another build): --force-reinstall, and --no-deps to leave torch as it is."""
    (tmp_path / "broken" / "torchvision").mkdir(parents=True)
    (tmp_path / "broken" / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    refused = subprocess.run([sys.executable, "-m", "ampctl", *command, f"hydra.run.dir={tmp_path / 'run'}"],
                             capture_output=True, text=True, cwd=tmp_path, timeout=300,
                             env={**os.environ, "PYTHONPATH": f"{tmp_path / 'broken'}:{REPO}"})
    line = one_line_refusal(refused, command[0])
    recipe = command[1]
    assert f"{recipe}: torchvision " in line and " does not match torch " in line, line
    assert "pip install --force-reinstall --no-deps 'torchvision==0." in line and not (tmp_path / "run").exists()


def test_a_config_that_is_not_ampctls_is_refused_before_it_touches_a_run(tmp_path):
    """A --cfg job dump from before it wrote its defaults list (or any primary config without `- train`) would
    run without ampctl's callbacks: it overwrote an earlier run's metrics.jsonl. Refused in one line."""
    first = ampctl.train([*MLP, "train.steps=3"], run_dir=tmp_path / "run")
    before = snapshot(first.run_dir)
    dump = cli("train", *MLP, "train.steps=2", "--cfg", "job", cwd=tmp_path)
    assert dump.returncode == 0, dump.stderr
    (tmp_path / "old.yaml").write_text(dump.stdout.split("  - _self_\n", 1)[1])  # the values, no defaults list
    refused = cli("train", "-cd", str(tmp_path), "-cn", "old", f"hydra.run.dir={first.run_dir}", cwd=tmp_path)
    assert "-cn old: the config does not start from ampctl's train config" in one_line_refusal(refused, "train")
    assert snapshot(first.run_dir) == before


def test_a_config_that_includes_itself_is_one_line(tmp_path):
    (tmp_path / "self.yaml").write_text("defaults:\n  - self\n")
    refused = cli("train", "-cd", str(tmp_path), "-cn", "self", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert "the config self includes itself in its defaults list" in one_line_refusal(refused, "train")


def test_init_next_to_a_file_in_its_way_writes_nothing(tmp_path, capsys, restore_argv):
    (tmp_path / "recipe").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main(["init", "x", "--dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "(nothing was written)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe"]


@pytest.mark.parametrize("command", [["list"], ["train", *MLP]])
def test_an_assumed_cpu_of_no_known_kind_is_one_line_before_anything_runs(tmp_path, command):
    from tests.support.in_process import run_ampctl

    refused = run_ampctl(*command, "hydra.run.dir=run" if command[0] == "train" else "device=cpu", cwd=tmp_path,
                         env={"AMPCTL_ASSUME_CPU": "m1"})
    assert "AMPCTL_ASSUME_CPU=m1: no such kind of CPU; choose one of avx2, avx512_bf16, amx" in one_line_refusal(
        refused, command[0])
    assert not (tmp_path / "run").exists()


# --- ampctl export (issue 38) -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exportable_run(tmp_path_factory):
    """An mlp run with its checkpoint (no weight average)."""
    root = tmp_path_factory.mktemp("export")
    trained = cli("train", *MLP, "train.steps=2", f"hydra.run.dir={root / 'run'}", cwd=root)
    assert trained.returncode == 0, trained.stderr
    return root / "run"


@pytest.mark.parametrize("args,named", [
    ([], "expected PATH first (a run directory or a checkpoint), then export.KEY=VALUE overrides"),
    (["export.dtype=float16"], "expected PATH first (a run directory or a checkpoint), then export.KEY=VALUE "
                               "overrides; got 'export.dtype=float16'"),
    # composed from conf/export.yaml as every command's config is: the same one lines as train's
    (["RUN", "export.dtype=fp16"], "export.dtype='fp16' is not allowed: expected one of float32, bfloat16, float16"),
    (["RUN", "export.format=onnx"], "export.format='onnx' is not allowed: expected one of safetensors, pt, hf"),
    (["RUN", "export.weights=swa"], "export.weights='swa' is not allowed: expected one of model, ema"),
    (["RUN", "export.dtyp=float16"], "export.dtyp: no such key (did you mean export.dtype?); allowed: dtype, format, "
                                     "weights, dir, max_file_mb, consolidate"),
    (["RUN", "export.max_file_mb=0"], "export.max_file_mb=0.0 is not allowed: expected a number of MiB > 0"),
    (["RUN", "dtype=float16"], "dtype: no such key; allowed: export"),
    (["RUN", "export.weights=ema"], "export.weights=ema: RUN/checkpoints/step_00000002.pt holds no weight average "
                                    "(the run was trained without train.ema.decay); choose export.weights=model"),
    (["RUN", "export.format=hf"], "export.format=hf is for recipe=hf_causal_lm (a transformers model); this run's "
                                  "recipe is ampctl.recipes.mlp.MLPRecipe"),
    (["RUN/nowhere"], "PATH='RUN/nowhere' does not exist; give a run directory or a checkpoint"),
    (["RUN/.hydra"], "PATH='RUN/.hydra' holds no checkpoint"),
])
def test_export_refuses_in_one_line_and_writes_nothing(exportable_run, args, named):
    before = snapshot(exportable_run)
    run = str(exportable_run)
    refused = cli("export", *[a.replace("RUN", run) for a in args], cwd=exportable_run.parent)
    assert named.replace("RUN", run) in one_line_refusal(refused, "export")
    assert snapshot(exportable_run) == before and not (exportable_run / "exports").exists()


def test_export_never_replaces_a_directory_and_a_changed_checkpoint_is_refused(exportable_run, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("the user's")
    refused = cli("export", str(exportable_run), f"export.dir={taken}", cwd=tmp_path)
    assert f"export.dir={taken} exists already; choose another export.dir (nothing was written)" in \
        one_line_refusal(refused, "export")
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]
    copy = tmp_path / "copy"
    shutil.copytree(exportable_run, copy)
    flipped = copy / "checkpoints" / "step_00000002.pt"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    refused = cli("export", str(copy), cwd=tmp_path)
    assert "no checkpoint passes its check" in one_line_refusal(refused, "export")
    assert not (copy / "exports").exists()
    # the same export twice: the second is refused, the first left as it was
    first = cli("export", str(exportable_run), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    written = snapshot(exportable_run / "exports")
    again = cli("export", str(exportable_run), cwd=tmp_path)
    assert "exists already" in one_line_refusal(again, "export")
    assert snapshot(exportable_run / "exports") == written


@pytest.mark.parametrize("format,checkpoint", [("safetensors", "full"), ("pt", "full"), ("safetensors", "sharded")])
def test_an_export_onto_a_full_disk_is_one_line_and_exit_74(exportable_run, tmp_path, format, checkpoint):
    """The writers' own errors: safetensors' Rust writer says "(os error 27)" in a SafetensorError, torch's zip
    writer a RuntimeError with the OSError as its context, DCP's HuggingFace writer (a sharded checkpoint's export)
    a CheckpointException around it; each was a traceback and exit 1. A file size limit refuses the write as a full
    disk would (EFBIG, SIGXFSZ ignored), without filling the machine's disk."""
    import resource
    import signal

    if checkpoint == "sharded":
        trained = cli("train", *MLP, "train.steps=2", "distributed.checkpoint_format=sharded",
                      f"hydra.run.dir={tmp_path / 'sharded'}", cwd=tmp_path)
        assert trained.returncode == 0, trained.stderr
        exportable_run = tmp_path / "sharded"

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    out = tmp_path / "deep" / "out"
    refused = subprocess.run([sys.executable, "-m", "ampctl", "export", str(exportable_run), f"export.dir={out}",
                              f"export.format={format}"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=small_files)
    assert refused.returncode == 74, refused.stderr
    assert refused.stderr.endswith(f"ampctl export: error: cannot write {out}: File too large (nothing was written)\n")
    assert "Traceback" not in refused.stderr and not (tmp_path / "deep").exists()


def test_an_export_that_cannot_be_written_leaves_nothing(exportable_run, tmp_path, monkeypatch):
    import safetensors.torch

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "out" / "model.safetensors"))

    monkeypatch.setattr(safetensors.torch, "save_model", full_disk)
    refused = cli("export", str(exportable_run), f"export.dir={tmp_path / 'deep' / 'out'}", cwd=tmp_path)
    assert refused.returncode == 74, refused.stderr
    assert refused.stderr.startswith("ampctl export: error: cannot write ") and "No space left" in refused.stderr
    assert not (tmp_path / "deep").exists()  # nor the folders it made for it


# --- the command line's smaller mistakes (issue 51) ------------------------------------------------------------


@pytest.mark.parametrize("args,named", [
    (["--bogus-flag"], "--bogus-flag: no such flag; overrides are key=value, and --help lists the flags"),
    (["-cn", "nope"], "-cn nope: no config nope.yaml in ampctl's configs or a -cd directory; give -cd DIR with "
                      "nope.yaml in it (ampctl init nope writes one)"),
    (["recipe=hf_causal_lm", "recipe.corpus=EMPTY"], "recipe.corpus='EMPTY' holds 0 bytes: give a text file, or a "
                                                     "directory of them, that is not empty"),
])
def test_a_flag_a_config_or_a_corpus_that_is_not_there_is_one_line(tmp_path, args, named):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    refused = cli("train", *[a.replace("EMPTY", str(empty)) for a in args], f"hydra.run.dir={tmp_path / 'run'}",
                  cwd=tmp_path)
    assert named.replace("EMPTY", str(empty)) in one_line_refusal(refused, "train")
    assert not (tmp_path / "run").exists()


def test_an_api_override_that_is_not_a_string_is_named(tmp_path):
    from ampctl.errors import UsageError

    with pytest.raises(UsageError, match=r"overrides: 123 \(int\) is not a string: each override is key=value"):
        ampctl.train([123], run_dir=tmp_path / "run")  # type: ignore[list-item]
    assert not (tmp_path / "run").exists()
