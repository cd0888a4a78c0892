"""`ampctl diff` (analysis/layer_errors.py, studies/diffing/diff.py): a reference against itself reads exactly 0; a
recipe
built to break in one known layer (recipe=fragile, recipes/demonstrations.py) has that layer ranked first by local error
in fp16, bf16, an FP8 and two MX modes, and the layer after it, which inherits the whole error, is not blamed; the
figures against the definitions computed by hand (hooks, hand-cast tensors, a hand-written scaled backward); the
files, and `ampctl report` writing them again; the repair's search and its proof by training."""

from __future__ import annotations

import contextlib
import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F

import ampctl
from ampctl.analysis.layer_errors import Side, measure
from ampctl.recipes.mlp import MLPRecipe
from tests.support.in_process import run_ampctl

FRAGILE = ["device=cpu", "recipe=fragile"]
MLP = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16"]


def test_a_reference_against_itself_reads_exactly_zero():
    recipe = MLPRecipe(hidden=32, batch_size=16)
    torch.manual_seed(0)
    first = recipe.build_model()
    second = recipe.build_model()
    second.load_state_dict(first.state_dict())
    off = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    sides = [Side(m, contextlib.nullcontext, off) for m in (first, second)]
    batches = list(itertools.islice(recipe.batches(torch.device("cpu"), 0), 3))
    layers, model = measure(*sides, recipe.loss, batches)
    assert len(layers) == 10 and model.loss_error() == 0.0 and model.gradient.rel_rms == 0.0
    for layer in layers.values():
        for sums in (*layer.local.values(), *layer.total.values(), layer.inherited_input, layer.inherited_grad):
            assert sums.diff_sq == 0.0 and sums.max_abs == 0.0 and sums.nonfinite == 0
    assert model.noise() is not None and model.noise() > 0


def test_a_layer_no_gradient_reaches_has_the_local_error_of_its_output():
    """The offset recipe's first layer, `center`, is frozen and takes the data (which needs no gradient): nothing
    flows back into it, and its output's local error is still measured: bf16's identity Linear on 512 + x against
    fp32's, computed by hand (the relative RMS error of the output)."""
    from ampctl.recipes.demonstrations import RoundingSpikeRecipe

    recipe = RoundingSpikeRecipe(spike_at=1)
    torch.manual_seed(0)
    reference, candidate = recipe.build_model(), recipe.build_model()
    candidate.load_state_dict(reference.state_dict())
    off = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    batch = next(recipe.batches(torch.device("cpu"), 0))
    layers, _ = measure(Side(reference, contextlib.nullcontext, off), Side(candidate, contextlib.nullcontext, bf16),
                        recipe.loss, [batch])
    x = batch[0]
    exact = (x - x.mean(-1, keepdim=True)).double()
    with bf16():
        h = F.linear(x, torch.eye(16))
        by_hand = (h - h.mean(-1, keepdim=True)).double()
    expected = math.sqrt(float((by_hand - exact).pow(2).sum() / exact.pow(2).sum()))
    assert layers["center"].local["out"].rel_rms == pytest.approx(expected, rel=1e-6) and expected > 0.1
    assert layers["center"].local["dgrad"].values == 0 and layers["center"].local["wgrad"].values == 0


@pytest.mark.parametrize("mode", ["fp16", "bf16", "fp8_emulated", "mxfp8", "mxfp4"])
def test_the_layer_built_to_break_ranks_first_and_the_layer_after_it_is_not_blamed(tmp_path, mode):
    result = ampctl.diff([*FRAGILE, f"precision={mode}", "diff.batches=3"], out_dir=tmp_path / "diff")
    rows = {row["layer"]: row for row in result.summary["rows"]}
    ranked = [row["layer"] for row in result.summary["rows"]]
    assert ranked[0] == "cancel" and rows["cancel"]["out_local"] == pytest.approx(1.0, abs=1e-3)
    # `out` receives cancel's lost output (its input error ~1) and adds only its format's usual rounding
    assert rows["out"]["input_inherited"] > 0.9 and rows["out"]["out_total"] > 0.9
    assert rows["out"]["out_local"] < 0.3 and rows["inp"]["out_local"] < 0.3
    model = result.summary["model"]
    # cancel's weight is fixed: the gradient's error lies in the trainable layers around it, which inherit it
    assert {name for name, _ in model["largest_shares"]} == {"inp", "out"} and not model["below_the_noise"]
    assert {p.name for p in (tmp_path / "diff").iterdir()} >= {"diff.csv", "diff.json", "report.md",
                                                               "layer_errors.png"}


def _rel(cand: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = sum(float((c.double() - r.double()).pow(2).sum()) for c, r in zip(cand, ref))
    return math.sqrt(diff / sum(float(r.double().pow(2).sum()) for r in ref))


@pytest.mark.parametrize("mode,dtype,scale", [("bf16", torch.bfloat16, 1.0), ("fp16", torch.float16, 65536.0)])
def test_the_figures_are_the_definitions_computed_by_hand(tmp_path, mode, dtype, scale):
    """The first Linear's local output and weight-gradient error (its input is the data: local is total), the
    loss's and the whole gradient's error, and the gradient's noise across the batches, written out here with
    torch.autocast, a forward hook and a hand-scaled backward."""
    batches_n, seed = 3, 2
    result = ampctl.diff([*MLP, f"precision={mode}", f"diff.batches={batches_n}", f"train.seed={seed}"],
                         out_dir=tmp_path / "diff")
    row = next(r for r in result.summary["rows"] if r["layer"] == "0")
    model = result.summary["model"]
    recipe = MLPRecipe(hidden=32, batch_size=16)
    torch.manual_seed(seed)
    net = recipe.build_model()
    batches = list(itertools.islice(recipe.batches(torch.device("cpu"), seed), batches_n))
    first = net[0]
    outs, ref_outs, wgrads, ref_wgrads, grads, ref_grads, losses = [], [], [], [], [], [], []
    for x, y in batches:
        seen = {}

        def keep_its_gradient(_module, _args, out, seen=seen) -> None:
            out.register_hook(lambda g: seen.update(g=g))

        handle = first.register_forward_hook(keep_its_gradient)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        handle.remove()
        ref_grads.append([p.grad.clone() for p in net.parameters()])
        net.zero_grad()
        ref_out = first(x)
        ref_wgrads.append(torch.autograd.grad(ref_out, [first.weight, first.bias], seen["g"]))
        ref_outs.append(ref_out.detach())
        with torch.autocast("cpu", dtype=dtype):
            out = first(x)
            cand_loss = F.cross_entropy(net(x).float(), y)
        outs.append(out.detach())
        wgrads.append([g / scale for g in torch.autograd.grad(out, [first.weight, first.bias],
                                                              (seen["g"] * scale).to(out.dtype))])
        (cand_loss * scale).backward()
        grads.append([p.grad.double() / scale for p in net.parameters()])
        net.zero_grad()
        losses.append((loss.item(), cand_loss.item()))
    assert row["out_local"] == pytest.approx(_rel(outs, ref_outs), rel=1e-9)
    assert row["out_total"] == pytest.approx(row["out_local"], rel=1e-12)
    assert row["wgrad_local"] == pytest.approx(_rel([torch.cat([w.flatten() for w in g]) for g in wgrads],
                                                    [torch.cat([w.flatten() for w in g]) for g in ref_wgrads]),
                                               rel=1e-9)
    flat = lambda gs: [torch.cat([g.double().flatten() for g in b]) for b in gs]  # noqa: E731
    assert model["gradient_error"] == pytest.approx(_rel(flat(grads), flat(ref_grads)), rel=1e-9)
    stacked = torch.stack(flat(ref_grads))
    spread = float((stacked - stacked.mean(0)).pow(2).sum()) / (batches_n - 1)
    assert model["gradient_noise"] == pytest.approx(math.sqrt(spread / float(stacked.pow(2).sum() / batches_n)),
                                                    rel=1e-5)
    assert model["loss_error"] == pytest.approx(sum(abs(c - r) for r, c in losses) / batches_n, rel=1e-9)


def test_report_writes_a_diffs_files_again_from_its_record(tmp_path):
    out = tmp_path / "diff"
    ampctl.diff([*MLP, "precision=bf16", "diff.batches=2"], out_dir=out)
    before = json.loads((out / "diff.json").read_text())
    (out / "report.md").unlink()
    shown = run_ampctl("report", str(out), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "error by layer, ranked by the error each adds itself" in shown.stdout and "gradient:" in shown.stdout
    assert json.loads((out / "diff.json").read_text()) == before and (out / "report.md").is_file()


@pytest.mark.parametrize("overrides,said", [
    (["precision=fp32"], "precision=fp32 is the reference (diff.against=fp32)"),
    (["precision=bf16", "diff.batches=1"], "diff.batches=1 is not allowed: expected an integer >= 2"),
    (["precision=bf16", "diff.against=fp64"], "diff.against: 'fp64' is not a precision mode"),
])
def test_a_diff_that_cannot_be_measured_is_one_line_and_writes_nothing(tmp_path, overrides, said):
    refused = run_ampctl("diff", *MLP, *overrides, f"hydra.run.dir={tmp_path / 'diff'}", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("ampctl diff: error: ") and said in refused.stderr, refused.stderr
    assert not (tmp_path / "diff").exists()


def test_a_diff_at_a_runs_weights_starts_from_its_checkpoint(tmp_path):
    """diff.weights=<run dir>: both models hold the run's trained weights (the reference's loss over the diff's
    batches is the trained model's, computed here from the checkpoint by hand); a run of another recipe is refused
    in one line naming what differs, and nothing is written."""
    trained = ampctl.train([*MLP, "train.steps=20", "train.console=quiet"], run_dir=tmp_path / "run")
    result = ampctl.diff([*MLP, "precision=bf16", "diff.batches=2", f"diff.weights={trained.run_dir}"],
                         out_dir=tmp_path / "diff")
    payload = torch.load(next((trained.run_dir / "checkpoints").glob("step_*.pt")), weights_only=False)
    recipe = MLPRecipe(hidden=32, batch_size=16)
    net = recipe.build_model()
    net.load_state_dict(payload["model"])
    losses = [recipe.loss(net, batch).item() for batch in itertools.islice(recipe.batches(torch.device("cpu"), 0), 2)]
    assert result.summary["model"]["reference_loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)
    refused = run_ampctl("diff", "device=cpu", "recipe=mlp", "precision=bf16", f"diff.weights={trained.run_dir}",
                         f"hydra.run.dir={tmp_path / 'other'}", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "its run trained another recipe (recipe.batch_size, recipe.hidden differ)" in refused.stderr
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("mode,raised", [("fp16", "fp32"), ("bf16", "fp32"), ("fp8_emulated", "unconverted"),
                                         ("mxfp8", "unconverted"), ("mxfp4", "unconverted")])
def test_repair_raises_the_broken_layer_first_and_its_config_runs_as_written(tmp_path, mode, raised):
    """diff.repair=true on the recipe built to break: `cancel` is raised first, one step (a format to unconverted, a
    half type to fp32), and no set without it is enough; what else the chosen set holds is what its measurement
    needed (under autocast the duplication's backward before `cancel` cancels too, in `inp`'s output type; in
    mxfp8, `out`'s own rounding is over the yardstick once `cancel` is repaired). The error recorded for the set is
    what a diff with the rules typed measures; repaired.yaml trains as written, the rules in its config."""
    out = tmp_path / "diff"
    result = ampctl.diff([*FRAGILE, f"precision={mode}", "diff.batches=3", "diff.repair=true"], out_dir=out)
    repair = result.summary["repair"]
    chosen = repair["chosen"]["rules"]
    assert chosen[0] == {"match": "cancel", "run_in": raised}
    assert repair["chosen"]["error_over_noise"] <= 0.1 < result.summary["model"]["error_over_noise"]
    assert all(t["error_over_noise"] > 0.1 for t in repair["tried"] if "cancel" not in [r["match"] for r in t["rules"]])
    typed = "[" + ",".join("{match:" + r["match"] + ",run_in:" + r["run_in"] + "}" for r in chosen) + "]"
    again = ampctl.diff([*FRAGILE, f"precision={mode}", "diff.batches=3", f"precision.rules={typed}"],
                        out_dir=tmp_path / "again")
    assert again.summary["model"]["gradient_error"] == pytest.approx(repair["chosen"]["gradient_error"], rel=1e-9)
    trained = run_ampctl("train", "-cd", str(out), "-cn", "repaired", "train.steps=3", "train.console=quiet",
                         f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    config = json.loads((tmp_path / "run" / "identity.json").read_text())["config"]
    assert config["precision"]["rules"][:len(chosen)] == [{**r, "type": None} for r in chosen]
    # a repair that raises every layer the mode converts says what is left: the mode without its format
    converted = set(result.summary["model"]["converted_layers"])
    whole = bool(converted) and converted <= {r["match"] for r in chosen}
    assert ("what is left is the mode without its format" in (out / "report.md").read_text()) == whole
    assert whole == (mode == "mxfp4")  # mxfp4 needs all three of the fragile recipe's Linear layers raised


def test_repair_of_a_mode_already_under_the_yardstick_raises_nothing(tmp_path):
    result = ampctl.diff([*MLP, "precision=bf16", "diff.batches=3", "diff.repair=true"], out_dir=tmp_path / "diff")
    assert result.summary["model"]["below_the_noise"]
    assert result.summary["repair"]["chosen"]["rules"] == [] and not (tmp_path / "diff" / "repaired.yaml").exists()


def test_the_proof_trains_the_repair_and_claims_only_what_the_seeds_decide(tmp_path):
    """diff.prove=true on the recipe built to break, in bf16: fp32, bf16 and bf16 with the repair trained side by
    side over three seeds; bf16 alone differs from fp32's held-out loss (it cannot learn through `cancel`), the
    repaired mode matches it: proved. With no budget left the same proof is cut short and claims nothing."""
    args = [*FRAGILE, "precision=bf16", "diff.batches=3", "diff.repair=true", "diff.prove=true", "train.steps=120",
            "compare.seeds=3"]
    result = ampctl.diff(args, out_dir=tmp_path / "diff")
    proof = result.summary["proof"]
    assert proof["verdict"] == "proved", proof
    assert proof["parity"] == {"fp32": None, "bf16": "differs", "bf16_repaired": "matches"}
    record = json.loads((tmp_path / "diff" / "proof" / "comparison.json").read_text())
    rows = {r["precision"]: r for r in record["rows"]}
    assert rows["bf16"]["eval_loss_delta"] > 0.3 and abs(rows["bf16_repaired"]["eval_loss_delta"]) < 0.05
    cut = ampctl.diff([*args, "diff.budget=1s"], out_dir=tmp_path / "cut")
    assert cut.summary["proof"]["verdict"] in ("partial", "not decided")
    assert "diff.budget ran out" in cut.summary["proof"]["words"]
