"""The MoE recipe in real runs: step for step equal to a hand-written torch.amp loop in fp32 and bf16 (its routers in
fp32 by hand, as the model's own rule keeps them) and to Apex O2 written by hand, trained in every kind of mode, its
routers' precision on the start line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ampctl.recipes.moe import MoERecipe, Router
from tests.support.golden import GOLDEN
from tests.support.training import QUIET, train_here

SIZES = {"n_layers": 2, "d_model": 32, "n_heads": 2, "expert_hidden": 32, "block_size": 32, "batch_size": 4,
         "max_corpus_bytes": 200_000, "experts": 4, "top_k": 2}
TINY = ["recipe=moe", *(f"recipe.{key}={value}" for key, value in SIZES.items()), *QUIET]


def hand_loop(dtype: torch.dtype | None, steps: int, bias_update_speed: float = 0.0) -> list[float]:
    """autocast (dtype; None: fp32) as torch's examples write it, the routers kept in fp32 by hand; with
    bias_update_speed, DeepSeek-V3's expert bias moved by hand after each step from the experts its routers chose."""
    recipe = MoERecipe(**SIZES, bias_update_speed=bias_update_speed)
    torch.manual_seed(3)
    model = recipe.build_model()
    routers = [m for m in model.modules() if isinstance(m, Router)]
    chosen: dict[Router, list[torch.Tensor]] = {router: [] for router in routers}
    for router in routers:
        def in_fp32(x: torch.Tensor, forward=router.forward, router=router) -> tuple:
            with torch.autocast("cpu", enabled=False):
                out = forward(x.float())
            chosen[router].append(out[2])
            return out
        router.forward = in_fp32
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    batches = recipe.batches(torch.device("cpu"), seed=3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = recipe.loss(model, next(batches))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        for router, choices in chosen.items():
            if bias_update_speed:
                load = torch.bincount(torch.cat(choices).reshape(-1), minlength=SIZES["experts"]).float()
                delta = bias_update_speed * torch.sign(load.mean() - load)
                router.expert_bias += delta - delta.mean()
            choices.clear()
    return losses


@pytest.mark.parametrize("precision,dtype", [("fp32", None), ("bf16", torch.bfloat16)])
def test_a_moe_run_equals_the_hand_written_loop_step_for_step(tmp_path, precision, dtype):
    _, rows = train_here(tmp_path, f"precision={precision}", "train.log_every=1", *GOLDEN, base=TINY)
    assert [r["loss"] for r in rows] == hand_loop(dtype, len(rows))


def test_deepseeks_expert_bias_moves_as_written_by_hand_and_a_resume_continues_it(tmp_path):
    """recipe.bias_update_speed: the run's losses equal the hand loop's that moves each router's bias itself; a run
    stopped at step 6 and resumed (the bias in its checkpoint) equals the whole run; the bias changed the run."""
    speed = ["recipe.bias_update_speed=0.01", "train.log_every=1", "train.checkpoint.every=6"]
    _, rows = train_here(tmp_path / "whole", "precision=fp32", *speed, *GOLDEN, base=TINY)
    assert [r["loss"] for r in rows] == hand_loop(None, len(rows), bias_update_speed=0.01)
    assert [r["loss"] for r in rows] != hand_loop(None, len(rows))
    train_here(tmp_path / "halves", "precision=fp32", *speed, *GOLDEN, "train.steps=6", base=TINY)
    _, resumed = train_here(tmp_path / "halves", "precision=fp32", *speed, *GOLDEN, "resume=auto", base=TINY)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]


def apex_o2_loop(steps: int) -> list[float]:
    """Apex O2 by hand, on the MoE: the model cast to fp16 but its LayerNorms and routers (fp32 weights, fp32 inputs,
    outputs back to fp16), its logits back to fp32 for the loss; AdamW steps fp32 copies of the half weights, the
    scaled half gradients copied into them before torch's GradScaler unscales and steps them; the half model is the
    masters rounded after every step."""
    recipe = MoERecipe(**SIZES)
    torch.manual_seed(3)
    model = recipe.build_model().half()
    for layer in (m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, Router))):
        layer.float()
        layer.register_forward_pre_hook(lambda _m, args: tuple(a.float() for a in args))
        layer.register_forward_hook(lambda _m, _a, out: (tuple(o.half() if o.is_floating_point() else o for o in out)
                                                          if isinstance(out, tuple) else out.half()))
    model.register_forward_hook(lambda _m, _a, out: out.float())
    pairs = [(p, torch.nn.Parameter(p.detach().float())) for p in model.parameters() if p.dtype == torch.float16]
    fp32_own = [p for p in model.parameters() if p.dtype == torch.float32]
    masters = {id(p): m for p, m in pairs}
    optimizer = torch.optim.AdamW([masters.get(id(p), p) for p in model.parameters()], lr=1e-3, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True)
    assert fp32_own  # the norms and routers are their own masters
    scaler = torch.amp.GradScaler("cpu")
    batches = recipe.batches(torch.device("cpu"), seed=3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        model.zero_grad()
        loss = recipe.loss(model, next(batches))
        scaler.scale(loss).backward()
        for half, master in pairs:
            master.grad = half.grad.float()
        scaler.step(optimizer)
        scaler.update()
        with torch.no_grad():
            for half, master in pairs:
                half.copy_(master)
        losses.append(loss.item())
    return losses


def test_an_o2_moe_run_equals_apex_o2_written_by_hand_step_for_step(tmp_path):
    _, rows = train_here(tmp_path, "precision=O2", "train.log_every=1", *GOLDEN, base=TINY)
    assert [r["loss"] for r in rows] == apex_o2_loop(len(rows))


@pytest.mark.parametrize("precision", ["O2", "fp16", "fp8_emulated", "mxfp8", "nvfp4"])
def test_every_kind_of_mode_trains_the_moe_recipe(tmp_path, precision):
    summary, rows = train_here(tmp_path, f"precision={precision}", "train.steps=4", "train.log_every=1", base=TINY)
    assert len(rows) == 4 and all(r["loss"] == r["loss"] for r in rows) and rows[-1]["loss"] < 6.0
    assert summary["precision"] == precision
    if summary["converter"] is not None:  # the format modes convert the experts too: 5 Linear layers and 2 experts
        assert summary["converter"]["layers"] == 7


def test_the_start_line_says_the_routers_run_in_fp32_by_the_models_rule(tmp_path, capsys):
    from ampctl.cli import main

    main(["train", *TINY, "precision=bf16", "train.steps=5", "train.console=plain", f"hydra.run.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "rules=[type=Router run_in=fp32 (the model's)]" in out
    assert "blocks.*.mlp.router.gate x2  Linear          float32   model's" in out
    assert "blocks.*.mlp.experts x2      GroupedExperts  bfloat16  mode" in out
    assert "| load " in out  # the busiest expert's tokens over the mean, on the live line


def first_choices(recipe: MoERecipe) -> dict[str, torch.Tensor]:
    """The experts each MoE layer's router chose for the first batch, in a hand-run forward of the run's model (seed
    3, as GOLDEN's runs build it)."""
    torch.manual_seed(3)
    model = recipe.build_model()
    chosen = {}
    for name, router in ((n, m) for n, m in model.named_modules() if isinstance(m, Router)):
        router.register_forward_hook(lambda m, a, out, name=name: chosen.update({name.rsplit(".", 1)[0]: out[2]}))
    idx, _ = next(recipe.batches(torch.device("cpu"), seed=3))
    model(idx)
    return chosen


def test_the_tokens_each_expert_got_are_the_hand_count(tmp_path):
    """experts.jsonl's first row (step 1: the initial weights, the first batch) against the experts each token's
    router chose in a hand-run forward of the same model and batch; the summary's load is its rows' mean."""
    summary, _ = train_here(tmp_path, "precision=fp32", "train.log_every=1", "telemetry.experts_every=1", *GOLDEN,
                            base=TINY)
    rows = [json.loads(line) for line in (tmp_path / "experts.jsonl").read_text().splitlines()]
    for layer, experts in first_choices(MoERecipe(**SIZES)).items():
        counts = [sum(int(e) == expert for e in experts.reshape(-1)) for expert in range(SIZES["experts"])]
        assert rows[0]["layers"][layer]["shares"] == [c / sum(counts) for c in counts]
        assert rows[0]["layers"][layer]["max_over_mean"] == max(counts) / (sum(counts) / len(counts))
    assert [row["step"] for row in rows] == list(range(1, 13))
    assert summary["expert_load"] == pytest.approx(sum(r["max_over_mean"] for r in rows) / len(rows))


def test_the_pairs_dropped_past_a_capacity_are_the_hand_count(tmp_path):
    """recipe.capacity_factor: experts.jsonl's first row says, per layer, the share of the first batch's (token, k)
    pairs past each expert's capacity, counted by hand from the experts each router chose; the summary's
    expert_dropped is its rows' mean of the worst layer's."""
    summary, _ = train_here(tmp_path, "precision=fp32", "recipe.capacity_factor=1.0", "train.log_every=1",
                            "telemetry.experts_every=1", *GOLDEN, base=TINY)
    rows = [json.loads(line) for line in (tmp_path / "experts.jsonl").read_text().splitlines()]
    for layer, experts in first_choices(MoERecipe(**SIZES, capacity_factor=1.0)).items():
        pairs = experts.numel()
        capacity = math.ceil(1.0 * pairs / SIZES["experts"])
        counts = [sum(int(e) == expert for e in experts.reshape(-1)) for expert in range(SIZES["experts"])]
        assert rows[0]["layers"][layer]["dropped"] == sum(max(0, c - capacity) for c in counts) / pairs
    assert rows[0]["dropped"] > 0
    assert summary["expert_dropped"] == pytest.approx(sum(r["dropped"] for r in rows) / len(rows))


def test_compare_says_how_the_load_balance_differs_between_modes(tmp_path):
    import csv

    from ampctl.cli import main

    sizes = [o for o in TINY if o.startswith("recipe")]
    main(["compare", *sizes, "device=cpu", "train.steps=6", "train.log_every=2", "compare.precisions=[fp32,bf16]",
          "compare.rounds=1", "compare.warmup_steps=1", f"hydra.run.dir={tmp_path}"])
    rows = {r["precision"]: r for r in csv.DictReader((tmp_path / "comparison.csv").open())}
    for mode in ("fp32", "bf16"):
        summary = json.loads((tmp_path / mode / "summary.json").read_text())
        assert float(rows[mode]["expert_load"]) == pytest.approx(summary["expert_load"]) and summary["expert_load"] >= 1


def test_a_transformers_mixture_of_experts_keeps_its_routers_in_fp32_and_diff_sees_them(tmp_path, capsys):
    """recipe=hf_causal_lm recipe.model_type=mixtral: transformers' own MoE (its TopKRouter, its fused experts)."""
    pytest.importorskip("transformers")
    from ampctl.cli import main

    small = ["recipe=hf_causal_lm", "recipe.model_type=mixtral", "recipe.batch_size=2", "recipe.block_size=32",
             "recipe.max_corpus_bytes=100000", "+recipe.config.num_hidden_layers=2", "device=cpu"]
    main(["train", *small, "precision=bf16", "train.steps=1", "train.console=plain", f"hydra.run.dir={tmp_path / 't'}"])
    out, err = capsys.readouterr()
    assert "rules=[type=*TopKRouter run_in=fp32 (the model's)]" in out and "Traceback" not in err
    main(["diff", *small, "precision=bf16", "diff.batches=2", f"hydra.run.dir={tmp_path / 'd'}"])
    routing = json.loads((tmp_path / "d" / "diff.json").read_text())["routing"]
    assert [r["router"] for r in routing] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    # routers kept in fp32: none flipped by their own precision
    assert all(r["tokens"] == 2 * 2 * 32 and r["own_flipped"] == 0.0 for r in routing)


def test_the_repair_raises_grouped_experts_out_of_their_format(tmp_path):
    """On recipe=moe in nvfp4, diff's ranking holds the experts (they add the most error of their own) and its repair
    raises them one step up, out of the format: `unconverted`, as a converted Linear is raised."""
    from ampctl.cli import main

    sizes = [o for o in TINY if o.startswith("recipe")]
    main(["diff", *sizes, "device=cpu", "precision=nvfp4", "diff.batches=2", "diff.repair=true",
          "diff.repair_layers=2", f"hydra.run.dir={tmp_path}"])
    record = json.loads((tmp_path / "diff.json").read_text())
    assert any(row["layer"].endswith("mlp.experts") and row["type"] == "MXGroupedExperts" for row in record["rows"])
    raised = [rule for tried in record["repair"]["tried"] for rule in tried["rules"]]
    assert {"match": "blocks.0.mlp.experts", "run_in": "unconverted"} in raised
