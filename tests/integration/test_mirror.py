"""train.checkpoint.mirror (runner/checkpointing/mirror.py): checkpoints kept off the machine at an fsspec URL, and a
run continued
from them on a machine that has none of it. Against fsspec's memory:// (in this process, whose runs share it) and
against moto's S3 server on 127.0.0.1 through s3fs: real S3 semantics, no rename, objects whole or absent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import fsspec
import pytest
import torch

from tests.support.adversarial import one_line_refusal
from tests.support.in_process import run_ampctl
from tests.support.runs import QUICK, REPO, ForkedAmpctl, steps

RUN = [*QUICK, "train.checkpoint.every=10", "train.checkpoint.keep=2"]


def _final_weights(run_dir: Path) -> dict:
    [last] = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1:]
    return torch.load(last, map_location="cpu", weights_only=False)["model"]


@pytest.fixture
def memory_mirror():
    url = f"memory://ampctl-test-{os.getpid()}-{id(object())}/run"
    yield url
    fs = fsspec.filesystem("memory")
    fs.rm(url.split("://")[1].split("/")[0], recursive=True)


def test_each_checkpoint_is_mirrored_whole_and_a_new_machine_continues_the_run_from_it(tmp_path, memory_mirror):
    first = run_ampctl("train", *RUN, "train.steps=30", f"train.checkpoint.mirror={memory_mirror}",
                       "hydra.run.dir=m1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    fs, root = fsspec.core.url_to_fs(memory_mirror)
    local = tmp_path / "m1"
    said = f"mirror: each checkpoint also to {memory_mirror} (train.checkpoint.mirror), its records with it"
    assert said in first.stdout and said in (local / "train.log").read_text()  # where the run's copies are
    # the newest keep_checkpoints, each byte for byte the local one, with its checksum; the identity and records
    mirrored = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/checkpoints", detail=False))
    assert mirrored == ["step_00000020.pt", "step_00000020.pt.sha256", "step_00000030.pt", "step_00000030.pt.sha256"]
    for name in mirrored:
        assert fs.cat_file(f"{root}/checkpoints/{name}") == (local / "checkpoints" / name).read_bytes(), name
    assert fs.cat_file(f"{root}/identity.json") == (local / "identity.json").read_bytes()
    assert fs.cat_file(f"{root}/metrics.jsonl") == (local / "metrics.jsonl").read_bytes()

    # another machine: an empty run directory, resume=auto, the mirror; against the same resume from the local copy
    pulled = run_ampctl("train", *RUN, "train.steps=50", f"train.checkpoint.mirror={memory_mirror}", "resume=auto",
                        "hydra.run.dir=m2", cwd=tmp_path)
    assert pulled.returncode == 0, pulled.stderr
    assert f"resume=auto: pulled step_00000030.pt and the run's records from {memory_mirror}" in pulled.stdout
    shutil.copytree(local, tmp_path / "m3")
    here = run_ampctl("train", *RUN, "train.steps=50", "resume=auto", "hydra.run.dir=m3", cwd=tmp_path)
    assert here.returncode == 0, here.stderr
    assert steps(tmp_path / "m2" / "metrics.jsonl") == list(range(1, 51))
    for key, value in _final_weights(tmp_path / "m3").items():
        assert torch.equal(_final_weights(tmp_path / "m2")[key], value), key
    assert json.loads((tmp_path / "m2" / "identity.json").read_text())["run_id"] == \
        json.loads((local / "identity.json").read_text())["run_id"]


def test_a_checkpoint_whose_upload_did_not_finish_or_whose_data_changed_is_never_pulled(tmp_path, memory_mirror):
    """An upload killed before its checksum (the commit marker, uploaded last) leaves a checkpoint no pull takes;
    one whose data does not match its checksum is passed over, said; with none left, one line and nothing left."""
    assert run_ampctl("train", *RUN, "train.steps=30", "train.checkpoint.keep=3",
                      f"train.checkpoint.mirror={memory_mirror}", "hydra.run.dir=m1", cwd=tmp_path).returncode == 0
    fs, root = fsspec.core.url_to_fs(memory_mirror)
    fs.rm(f"{root}/checkpoints/step_00000030.pt.sha256")  # killed between its data and its marker
    data = bytearray(fs.cat_file(f"{root}/checkpoints/step_00000020.pt"))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(f"{root}/checkpoints/step_00000020.pt", bytes(data))
    pulled = run_ampctl("train", *RUN, "train.steps=30", f"train.checkpoint.mirror={memory_mirror}", "resume=auto",
                        "hydra.run.dir=m2", cwd=tmp_path)
    assert pulled.returncode == 0, pulled.stderr
    assert "resume=auto: passed over the mirror's step_00000020.pt (its data does not match its checksum)" in \
        pulled.stdout and "pulled step_00000010.pt" in pulled.stdout, pulled.stdout
    assert steps(tmp_path / "m2" / "metrics.jsonl") == list(range(1, 31))

    for marker in fs.glob(f"{root}/checkpoints/*.sha256"):  # every upload cut short
        fs.rm(marker)
    none_left = run_ampctl("train", *RUN, "train.steps=30", f"train.checkpoint.mirror={memory_mirror}",
                           "resume=auto", "hydra.run.dir=m3", cwd=tmp_path)
    assert "holds a run but no checkpoint of it that verifies" in one_line_refusal(none_left, "train")
    assert not (tmp_path / "m3").exists()


def test_what_a_resume_to_an_older_checkpoint_sets_aside_the_mirror_sets_aside_too(tmp_path, memory_mirror):
    """Resumed at step 10 of a run mirrored to step 30 and stopped at 15: the run directory set aside 20 and 30, and
    so did the mirror, before the run trained on; a new machine continues the timeline the run is on (15), not the
    abandoned one (30)."""
    mirror = [*RUN, "train.checkpoint.keep=3", f"train.checkpoint.mirror={memory_mirror}"]
    assert run_ampctl("train", *mirror, "train.steps=30", "hydra.run.dir=m1", cwd=tmp_path).returncode == 0
    older = tmp_path / "m1" / "checkpoints" / "step_00000010.pt"
    again = run_ampctl("train", *mirror, "train.steps=15", f"resume={older}", "train.checkpoint.every=5",
                       "hydra.run.dir=m1", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    fs, root = fsspec.core.url_to_fs(memory_mirror)
    mirrored = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/checkpoints", detail=False))
    local = sorted(p.name for p in (tmp_path / "m1" / "checkpoints").glob("step_*"))
    assert local == ["step_00000010.pt", "step_00000010.pt.sha256", "step_00000015.pt", "step_00000015.pt.sha256"]
    assert mirrored == local and all(fs.cat_file(f"{root}/checkpoints/{name}") == (
        tmp_path / "m1" / "checkpoints" / name).read_bytes() for name in mirrored)


def test_an_escalation_sets_aside_the_mirrors_abandoned_timeline_before_training_on(tmp_path, memory_mirror):
    """The mirror of a run that went back to step 4 (its checkpoints 2, 4, 6 uploaded): 6 set aside, the records
    those of the timeline from 4 with escalations.jsonl; a machine that pulls the run then takes step 4 and the
    escalation's rules, whichever moment it was killed after the escalation's line."""
    from ampctl.runner.checkpointing.mirror import Mirror, pull
    from ampctl.runner.ownership import start_timeline_at

    run = tmp_path / "run"
    assert run_ampctl("train", *RUN, "train.steps=6", "train.checkpoint.every=2", "train.checkpoint.keep=3",
                      f"train.checkpoint.mirror={memory_mirror}", f"hydra.run.dir={run}", cwd=tmp_path).returncode == 0
    start_timeline_at(run, 4)  # as the escalation does, then its record
    (run / "escalations.jsonl").write_text('{"number": 1, "step": 4, "rules": []}\n')
    mirror = Mirror(memory_mirror, run, print)
    mirror.upload(run / "checkpoints" / "step_00000004.pt")  # a queued upload: the set-aside waits its turn
    mirror.start_timeline_at(4)
    assert mirror.close() == []
    pulled = tmp_path / "pulled"
    assert pull(memory_mirror, pulled, print)
    assert sorted(p.name for p in (pulled / "checkpoints").glob("step_*.pt")) == ["step_00000004.pt"]
    assert steps(pulled / "metrics.jsonl") == [1, 2, 3, 4]
    assert (pulled / "escalations.jsonl").read_bytes() == (run / "escalations.jsonl").read_bytes()


def test_an_s3_endpoint_that_never_answers_is_said_as_it_waits_and_refused_naming_it(tmp_path, monkeypatch):
    """A server that takes the connection and never answers: the run's start said what it waited for, then one line
    naming the endpoint (it was silent for 6 min 40 s of the S3 client's retries, then named only the client's
    error); nothing written. The patience shortened for the test."""
    import socket

    from ampctl.runner.checkpointing import mirror_check

    pytest.importorskip("s3fs")
    monkeypatch.setattr(mirror_check, "CHECK_PATIENCE_S", 3.0)
    monkeypatch.setattr(mirror_check, "SAY_WAITING_AFTER_S", 0.5)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel takes the connections; nothing ever reads them
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        done = run_ampctl("train", *RUN, "train.checkpoint.mirror=s3://bucket/run", "hydra.run.dir=run",
                          f"+train.checkpoint.mirror_options.endpoint_url={endpoint}", cwd=tmp_path,
                          env={"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"})
    finally:
        silent.close()
    assert f"checking train.checkpoint.mirror=s3://bucket/run at endpoint {endpoint} (up to 3 s)..." in done.stdout
    assert one_line_refusal(done, "train").strip() == (
        f"ampctl train: error: train.checkpoint.mirror=s3://bucket/run: endpoint {endpoint} did not answer within 3 "
        "s; check that it is up and reachable from here (or give its file system's timeouts in "
        "train.checkpoint.mirror_options)")
    assert not (tmp_path / "run").exists()


def test_a_mirror_holds_one_run_and_a_mirror_that_cannot_be_used_is_one_line(tmp_path, memory_mirror):
    assert run_ampctl("train", *RUN, "train.steps=10", f"train.checkpoint.mirror={memory_mirror}",
                      "hydra.run.dir=m1", cwd=tmp_path).returncode == 0
    other = run_ampctl("train", *RUN, "train.steps=10", f"train.checkpoint.mirror={memory_mirror}",
                       "hydra.run.dir=m2", cwd=tmp_path)
    assert "holds another run's checkpoints (run " in one_line_refusal(other, "train")
    assert not (tmp_path / "m2").exists()
    fs, root = fsspec.core.url_to_fs(memory_mirror)
    fs.pipe_file(f"{root}-theirs/metrics.jsonl", b"someone else's\n")  # a prefix with files and no run
    theirs = run_ampctl("train", *RUN, "train.steps=10", f"train.checkpoint.mirror={memory_mirror}-theirs",
                        "hydra.run.dir=m4", cwd=tmp_path)
    assert "holds files of its own (metrics.jsonl) and no run" in one_line_refusal(theirs, "train")
    assert fs.cat_file(f"{root}-theirs/metrics.jsonl") == b"someone else's\n" and not (tmp_path / "m4").exists()
    fs.rm(f"{root}-theirs", recursive=True)
    for url, said in (("gs://bucket/run", "the gs:// file system is not installed; pip install 'ampctl[gcs]'"),
                      ("nosuchfs://bucket/run", "fsspec knows no protocol 'nosuchfs'")):
        if url.startswith("gs") and _installed("gcsfs"):
            continue
        refused = run_ampctl("train", *RUN, "train.steps=10", f"train.checkpoint.mirror={url}", "hydra.run.dir=m3",
                             cwd=tmp_path)
        assert said in one_line_refusal(refused, "train") and not (tmp_path / "m3").exists()
    # a path that cannot be written: said before the run directory is made (it said so at the first upload, and
    # left a run directory that refused the same command again)
    read_only = run_ampctl("train", *RUN, "train.steps=10", "train.checkpoint.mirror=file:///sys/ampctl-test-mirror",
                           "hydra.run.dir=m5", cwd=tmp_path)
    assert ("train.checkpoint.mirror=file:///sys/ampctl-test-mirror: /sys cannot be written (" in
            one_line_refusal(read_only, "train")) and not (tmp_path / "m5").exists()
    compared = run_ampctl("compare", *RUN, "train.steps=2", f"train.checkpoint.mirror={memory_mirror}",
                          "compare.precisions=[fp32]", "hydra.run.dir=cmp", cwd=tmp_path)
    assert "are not mirrored; train.checkpoint.mirror is for an ampctl train run" in \
        one_line_refusal(compared, "compare")


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.fixture
def s3_server():
    """moto's S3 server on 127.0.0.1, with a bucket; s3fs reaches it through fsspec's configuration variables.
    Skipped without s3fs or moto, except in CI, where [dev] installs both: there it must run."""
    if os.environ.get("CI"):
        import moto.server as server_module
        import s3fs  # noqa: F401 - CI's [dev] install has it: a skip would hide the S3 path
    else:
        pytest.importorskip("s3fs")
        server_module = pytest.importorskip("moto.server")
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # moto's backends are the process's, shared by every server it starts: a test's buckets start empty
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
    env = {"FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    fsspec.config.set_conf_env(fsspec.config.conf)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("ampctl-runs")
    try:
        yield env
    finally:
        server.stop()
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        fsspec.config.conf.pop("s3", None)


@pytest.mark.slow
def test_a_run_mirrored_to_s3_continues_on_another_machine_from_its_newest_whole_checkpoint(tmp_path, s3_server):
    """Through s3fs against moto's S3 server, in real processes (each with the credentials and endpoint a user
    sets in the environment): the run mirrors its checkpoints, and resume=auto in an empty directory continues it;
    the newest checkpoint's marker removed (its upload killed before its end) makes the pull take the one before."""
    env = {**os.environ, **s3_server, "PYTHONPATH": str(REPO)}
    url = "s3://ampctl-runs/run"

    def ampctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ampctl", "train", *RUN, f"train.checkpoint.mirror={url}", *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    first = ampctl("train.steps=30", "hydra.run.dir=m1")
    assert first.returncode == 0 and "not mirrored" not in first.stdout + first.stderr, first.stderr[-2000:]
    # botocore's INFO line about where it found the credentials is not the run's to print
    assert "Found credentials" not in first.stdout + first.stderr
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ampctl-runs/run/checkpoints")) == \
        ["step_00000020.pt", "step_00000020.pt.sha256", "step_00000030.pt", "step_00000030.pt.sha256"]
    fs.rm("ampctl-runs/run/checkpoints/step_00000030.pt.sha256")
    pulled = ampctl("train.steps=40", "resume=auto", "hydra.run.dir=m2")
    assert pulled.returncode == 0, pulled.stderr[-2000:]
    assert "resume=auto: pulled step_00000020.pt" in pulled.stdout, pulled.stdout
    assert steps(tmp_path / "m2" / "metrics.jsonl") == list(range(1, 41))
    # the continued run mirrors on: the mirror holds its newest checkpoints now
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ampctl-runs/run/checkpoints", refresh=True)) == \
        ["step_00000030.pt", "step_00000030.pt.sha256", "step_00000040.pt", "step_00000040.pt.sha256"]
    # a bucket that does not exist is refused, not created (s3fs's makedirs would make it)
    url = "s3://ampctl-no-such-bucket/run"
    missing = ampctl("train.steps=10", "hydra.run.dir=m3")
    assert missing.returncode == 2 and missing.stderr == (
        "ampctl train: error: train.checkpoint.mirror=s3://ampctl-no-such-bucket/run: the bucket "
        "'ampctl-no-such-bucket' does not exist; create it, or name one that does\n"), missing.stderr
    assert not fs.exists("ampctl-no-such-bucket") and not (tmp_path / "m3").exists()
    # two runs started together at one S3 URL: the claim is S3's conditional write (If-None-Match), one run goes on
    fs.mkdir("ampctl-race")
    url = "s3://ampctl-race/run"
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    together = ["train.steps=10", "recipe._target_=tests.support.rendezvous_recipe.RendezvousRecipe",
                f"+recipe.rendezvous_dir={meeting}"]
    processes = [subprocess.Popen([sys.executable, "-m", "ampctl", "train", *RUN, f"train.checkpoint.mirror={url}",
                                   *together, f"train.seed={seed}", f"hydra.run.dir=race{seed}"], cwd=tmp_path, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (0, 1)]
    codes = sorted(p.wait(timeout=300) for p in processes)
    assert codes == [0, 2], [p.communicate() for p in processes]


def test_a_sharded_checkpoint_is_mirrored_manifest_last_and_pulled_whole(tmp_path, memory_mirror):
    """A DCP directory: its files, then its SHA256SUMS (the marker); pulled into a .tmp directory, checked against
    the manifest, renamed into place."""
    sharded = [*RUN, "distributed.checkpoint_format=sharded", f"train.checkpoint.mirror={memory_mirror}"]
    assert run_ampctl("train", *sharded, "train.steps=20", "hydra.run.dir=m1", cwd=tmp_path).returncode == 0
    fs, root = fsspec.core.url_to_fs(memory_mirror)
    local = tmp_path / "m1" / "checkpoints" / "step_00000020.dcp"
    for file in local.iterdir():
        assert fs.cat_file(f"{root}/checkpoints/step_00000020.dcp/{file.name}") == file.read_bytes(), file.name
    pulled = run_ampctl("train", *sharded, "train.steps=30", "resume=auto", "hydra.run.dir=m2", cwd=tmp_path)
    assert pulled.returncode == 0 and "pulled step_00000020.dcp" in pulled.stdout, pulled.stderr
    assert steps(tmp_path / "m2" / "metrics.jsonl") == list(range(1, 31))


def test_a_checkpoint_pruned_before_its_upload_is_passed_over_and_a_cut_short_upload_is_pruned(tmp_path,
                                                                                               memory_mirror):
    """The uploads lag the run (the network): a checkpoint the run directory pruned before its turn is superseded,
    not a failure to warn of; data a cut-short upload left without its marker is pruned with the old ones."""
    from ampctl.runner.checkpointing.checkpoint_files import file_sha256
    from ampctl.runner.checkpointing.mirror import Mirror

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "identity.json").write_text('{"run_id": "abc"}')
    for step in (20, 30):
        path = run_dir / "checkpoints" / f"step_{step:08d}.pt"
        path.write_bytes(bytes([step]) * 100)
        (path.parent / (path.name + ".sha256")).write_text(f"{file_sha256(path)}  {path.name}\n")
    fs, root = fsspec.core.url_to_fs(memory_mirror)
    fs.pipe_file(f"{root}/checkpoints/step_00000005.pt", b"cut short")  # no marker
    warned: list[str] = []
    mirror = Mirror(memory_mirror, run_dir, warned.append)
    mirror.claim()
    mirror.upload(run_dir / "checkpoints" / "step_00000010.pt")  # pruned before its turn
    mirror.upload(run_dir / "checkpoints" / "step_00000030.pt")
    assert mirror.close() == [] and warned == []
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/checkpoints", detail=False)) == \
        ["step_00000030.pt", "step_00000030.pt.sha256"]


@pytest.mark.slow
def test_two_runs_started_together_at_one_mirror_one_claims_it_and_the_other_is_refused(tmp_path):
    """Both pass the plan's check of the mirror (it holds no run) before either writes to it: the claim is an
    exclusive create, so one run holds the mirror whole and the other is refused in one line, its directory removed
    and nothing of the winner's touched."""
    mirror, meeting = tmp_path / "mirror", tmp_path / "meeting"
    meeting.mkdir()
    together = [*RUN, "train.steps=20", f"train.checkpoint.mirror=file://{mirror}",
                "recipe._target_=tests.support.rendezvous_recipe.RendezvousRecipe", f"+recipe.rendezvous_dir={meeting}"]
    processes = [ForkedAmpctl("train", *together, f"train.seed={seed}", f"hydra.run.dir=r{seed}", cwd=tmp_path)
                 for seed in (0, 1)]
    ended = [(p.wait(timeout=240), *p.communicate()) for p in processes]
    [(winner, _)] = [(seed, e) for seed, e in enumerate(ended) if e[0] == 0]
    [(loser, (code, _out, err))] = [(seed, e) for seed, e in enumerate(ended) if e[0] != 0]
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "was claimed by another run (run " in err and "that started at the same moment" in err, err
    assert not (tmp_path / f"r{loser}").exists()
    ours = json.loads((tmp_path / f"r{winner}" / "identity.json").read_text())
    assert json.loads((mirror / "identity.json").read_text())["run_id"] == ours["run_id"]
    assert (mirror / "metrics.jsonl").read_bytes() == (tmp_path / f"r{winner}" / "metrics.jsonl").read_bytes()
    mirrored = sorted(p.name for p in (mirror / "checkpoints").iterdir())
    assert mirrored == sorted(p.name for p in (tmp_path / f"r{winner}" / "checkpoints").iterdir())
    for name in mirrored:
        assert (mirror / "checkpoints" / name).read_bytes() == (tmp_path / f"r{winner}" / "checkpoints" /
                                                                name).read_bytes()


def test_on_a_store_without_exclusive_create_a_later_claim_is_seen_before_the_first_upload(tmp_path, memory_mirror,
                                                                                            monkeypatch):
    """Where the file system refuses mode "xb" the identity is written where absent and read back; a run whose
    identity another overwrote after that finds it before its first upload and uploads nothing (said in a warning)."""
    from fsspec.implementations.memory import MemoryFileSystem

    from ampctl.runner.checkpointing import mirror as mirror_module

    opened = MemoryFileSystem._open

    def no_exclusive_create(self, path, mode="rb", *args, **kwargs):
        if "x" in mode:
            raise ValueError(f"unsupported file mode: {mode}")
        return opened(self, path, mode, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "_open", no_exclusive_create)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "identity.json").write_text(json.dumps({"run_id": "ours"}))
    warnings: list[str] = []
    ours = mirror_module.Mirror(memory_mirror, run_dir, warnings.append)
    ours.claim()  # written where absent, read back: ours
    fs, root = fsspec.core.url_to_fs(memory_mirror)
    fs.pipe_file(f"{root}/identity.json", json.dumps({"run_id": "theirs"}).encode())  # a claim after ours
    checkpoint = run_dir / "checkpoints" / "step_00000010.pt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"weights")
    (run_dir / "checkpoints" / "step_00000010.pt.sha256").write_text("digest  step_00000010.pt\n")
    ours.upload(checkpoint)
    assert ours.close() == ["step_00000010.pt"]
    assert "was claimed by another run (run theirs)" in warnings[0], warnings
    assert not fs.exists(f"{root}/checkpoints") and json.loads(fs.cat_file(f"{root}/identity.json")) == {
        "run_id": "theirs"}


@pytest.mark.slow
def test_the_mirrors_storage_options_reach_its_file_system(tmp_path, s3_server):
    """The endpoint given as train.checkpoint.mirror_options (fsspec's storage_options), not in the environment: the
    run mirrors through it; options that are not a mapping are one line."""
    env = {k: v for k, v in {**os.environ, **s3_server, "PYTHONPATH": str(REPO)}.items()
           if k != "FSSPEC_S3_ENDPOINT_URL"}
    endpoint = s3_server["FSSPEC_S3_ENDPOINT_URL"]
    done = subprocess.run([sys.executable, "-m", "ampctl", "train", *RUN, "train.steps=10",
                           "train.checkpoint.mirror=s3://ampctl-runs/options",
                           f"+train.checkpoint.mirror_options.endpoint_url={endpoint}", "hydra.run.dir=m1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "not mirrored" not in done.stdout + done.stderr, done.stderr[-2000:]
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    assert "step_00000010.pt" in [p.rsplit("/", 1)[-1] for p in fs.ls("ampctl-runs/options/checkpoints")]
    refused = run_ampctl("train", *RUN, "train.checkpoint.mirror=memory://options", "train.checkpoint.mirror_options=5",
                         "hydra.run.dir=m2", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "train.checkpoint.mirror_options" in refused.stderr and not (tmp_path / "m2").exists()
