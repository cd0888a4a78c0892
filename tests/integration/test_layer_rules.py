"""Per-layer precision rules: a run with rules equals the torch.amp loop with the same layers kept in fp32 by hand,
bit for bit, in fp16 and bf16; a dtype hook proves each Linear's matmul dtype and the resolved table says the
same; name and type matching; every refusal is one line; the rules with the converter modes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.cli import main
from ampctl.engine.build import build_state
from ampctl.engine.precision import layers
from ampctl.engine.precision.half import is_norm_layer
from ampctl.errors import UsageError
from tests.support.golden import GOLDEN, canonical_loop
from tests.support.layer_zoo import check_the_layer_table_against_hooks
from tests.support.training import build, train_here

HEAD = "9"  # the MLP's last Linear: [Linear, LayerNorm, GELU] x 3, then the head
FIRST_AND_LAST = f"precision.rules=[{{match:'0',run_in:fp32}},{{match:'{HEAD}',run_in:fp32}}]"


def keep_in_fp32_by_hand(model: nn.Module) -> None:
    """What a user writes without ampctl: autocast off around the first and last layers, inputs cast to fp32."""
    for index in (0, int(HEAD)):
        layer = model[index]
        forward = layer.forward

        def fp32_forward(x, forward=forward):
            with torch.autocast("cpu", enabled=False):
                return forward(x.float())

        layer.forward = fp32_forward


@pytest.mark.parametrize("precision,dtype,use_scaler", [("fp16", torch.float16, True), ("bf16", torch.bfloat16, False)])
def test_a_run_with_rules_equals_the_torch_amp_loop_with_those_layers_kept_by_hand(tmp_path, precision, dtype,
                                                                                     use_scaler):
    _, rows = train_here(tmp_path, f"precision={precision}", FIRST_AND_LAST, *GOLDEN)
    losses, scales, _ = canonical_loop(dtype, use_scaler, by_hand=keep_in_fp32_by_hand)
    assert [r["loss"] for r in rows] == losses
    assert [r["loss_scale"] for r in rows] == scales
    plain, _, _ = canonical_loop(dtype, use_scaler)
    assert losses != plain  # the rules changed what was computed


def linear_output_dtypes(*overrides: str) -> tuple[dict[str, torch.dtype], list[layers.LayerRow]]:
    """Each Linear's output dtype (its matmul's, under autocast) in one forward of ampctl's prepared model."""
    cfg, policy, recipe = build(*overrides)
    seen: dict[str, torch.dtype] = {}
    with policy:
        state = build_state(cfg, policy, recipe)
        for name, module in state.model.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
        with policy.forward_context():
            recipe.loss(state.model, next(recipe.batches(policy.device, 0)))
    return seen, policy.layer_rows


@pytest.mark.parametrize("precision,low", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_a_dtype_hook_proves_each_matmuls_dtype_and_the_table_says_the_same(precision, low):
    seen, rows = linear_output_dtypes(f"precision={precision}", FIRST_AND_LAST)
    assert seen == {"0": torch.float32, "3": low, "6": low, HEAD: torch.float32}
    by_name = {name: row for row in rows for name in row.names}
    for name, dtype in seen.items():
        assert by_name[name].compute == str(dtype).removeprefix("torch.")
    assert by_name["0"].rule == "rules[0]" and by_name[HEAD].rule == "rules[1]" and by_name["3"].rule == "mode"
    assert by_name["1"].compute == "as input"  # a LayerNorm: on a CPU autocast leaves layer_norm in its input's dtype


def test_a_bf16_rule_under_fp32_runs_that_layer_in_bf16_and_returns_fp32():
    seen, rows = linear_output_dtypes("precision=fp32", f"precision.rules=[{{match:'{HEAD}',run_in:bf16}}]")
    assert seen == {"0": torch.float32, "3": torch.float32, "6": torch.float32, HEAD: torch.float32}
    (head,) = [row for row in rows if HEAD in row.names]
    assert head.compute == "bfloat16"


def test_rules_match_by_type_glob_and_by_name_glob_first_match_wins():
    _, rows = linear_output_dtypes("precision=bf16", "precision.rules=[{match:'[36]',run_in:fp32},{type:'*Norm',"
                                   "run_in:fp32},{type:Linear,run_in:bf16}]")
    rules = {name: row.rule for row in rows for name in row.names}
    assert rules == {"0": "rules[2]", "1": "rules[1]", "3": "rules[0]", "4": "rules[1]", "6": "rules[0]",
                     "7": "rules[1]", HEAD: "rules[2]"}


def test_o2s_default_rule_keeps_every_norm_in_fp32_and_a_user_rule_adds_the_head(tmp_path):
    cfg, policy, recipe = build("precision=O2", f"precision.rules=[{{type:norm,run_in:fp32}},"
                                f"{{match:'{HEAD}',run_in:fp32}}]")
    with policy:
        model = build_state(cfg, policy, recipe).model
    dtypes = {name: m.weight.dtype for name, m in model.named_modules() if hasattr(m, "weight")}
    norms = {name for name, m in model.named_modules() if is_norm_layer(m)}
    assert {n for n, d in dtypes.items() if d == torch.float32} == norms | {HEAD}
    assert {n for n, d in dtypes.items() if d == torch.float16} == {"0", "3", "6"}


def test_the_first_and_last_layers_left_out_of_an_mx_format(tmp_path):
    seen, rows = linear_output_dtypes("precision=mxfp8", f"precision.rules=[{{match:'0',run_in:unconverted}},"
                                      f"{{match:'{HEAD}',run_in:unconverted}}]")
    kinds = {name: row.type for row in rows for name in row.names}
    assert {kinds["0"], kinds[HEAD]} == {"Linear"} and {kinds["3"], kinds["6"]} == {"MXLinear"}
    assert {name: row.compute for row in rows for name in row.names if name in ("3", HEAD)} == {
        "3": "mxfp8 (emulated)", HEAD: "float32"}


def test_a_format_rule_converts_one_layer_under_another_mode():
    _, rows = linear_output_dtypes("precision=bf16", f"precision.rules=[{{match:'{HEAD}',run_in:nvfp4}}]")
    (head,) = [row for row in rows if HEAD in row.names]
    assert (head.type, head.compute, head.converter) == ("MXLinear", "nvfp4 (emulated)", "mx_emulated")


@pytest.mark.parametrize("precision,rules,message", [
    ("bf16", "[{match:haed,run_in:fp32}]",
     "precision.rules[0] (match=haed run_in=fp32) matches no layer of this model; the closest layer names:"),
    ("bf16", "[{type:LayerNom,run_in:fp32}]",
     "precision.rules[0] (type=LayerNom run_in=fp32) matches no layer of this model; the closest layer types: "
     "LayerNorm"),
    ("bf16", f"[{{type:Linear,run_in:fp32}},{{match:'{HEAD}',run_in:bf16}}]",
     f"precision.rules[1] (match={HEAD} run_in=bf16) contradicts precision.rules[0] (type=Linear run_in=fp32), which "
     f"matches every layer it matches first ({HEAD})"),
    ("bf16", "[{type:LayerNorm,run_in:mxfp8}]",
     "precision.rules[0] (type=LayerNorm run_in=mxfp8): mxfp8 converts nn.Linear layers, and none of the layers it "
     "matches is or holds one (1, 4, 7)"),
    ("bf16", "[{type:Linear,run_in:unconverted}]",
     "precision.rules[0] (type=Linear run_in=unconverted): precision=bf16 converts no layers"),
    ("mxfp8", "[{type:LayerNorm,run_in:unconverted}]",
     "precision.rules[0] (type=LayerNorm run_in=unconverted): none of the layers it matches is or holds an nn.Linear"),
    ("bf16", "[{type:Linear,run_in:fp8}]",
     "precision.rules[0] (type=Linear run_in=fp8): fp8 needs FP8 tensor cores"),
    ("O2", "[{type:Linear,run_in:bf16}]",
     "precision.rules[0] (type=Linear run_in=bf16): precision=O2 stores the model's weights in float16"),
    ("O2", "[{type:Linear,run_in:mxfp4}]",
     "precision.rules[0] (type=Linear run_in=mxfp4): precision=O2 casts the model's weights to float16"),
    ("bf16", "[{type:Linear,run_in:fp9}]",
     "precision.rules[0] (type=Linear run_in=fp9): no such run_in (did you mean fp8?); choose fp32, bf16, fp16, "
     "unconverted or a format: "),
    ("bf16", "[{run_in:fp32}]", "precision.rules[].match=None is not allowed: expected a glob over layer names, or a "
     "type"),
    ("fp16", "[{type:LayerNorm,run_in:bf16}]",  # on a CPU layer_norm is on neither of autocast's lists
     "precision.rules[0] (type=LayerNorm run_in=bf16): torch.autocast on cpu runs none of the layers it decides in "
     "bfloat16 (1 (LayerNorm: as input), 4 (LayerNorm: as input), 7 (LayerNorm: as input); as input: autocast leaves "
     "that op in the dtype it is given), so the rule would change nothing; run_in=fp32 makes them fp32"),
])
def test_a_rule_that_cannot_be_honoured_is_refused_in_one_line(tmp_path, restore_argv, capsys, precision, rules,
                                                               message):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "recipe=mlp", "recipe.hidden=32", "device=cpu", "train.console=quiet", "train.steps=2",
              f"precision={precision}", f"precision.rules={rules}", f"hydra.run.dir={run}"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert message in line, line
    assert not run.exists()


@pytest.mark.parametrize("precision", ["nvfp4", "fp8_emulated"])
def test_a_model_that_is_one_linear_is_refused_by_a_mode_that_converts_layers(precision):
    """The converters swap layers inside the model, never the model object itself: a recipe whose model is one
    nn.Linear (docs/models.md's linear regression) would train in fp32 under the format's name."""
    _, policy, _ = build(f"precision={precision}")
    with pytest.raises(UsageError, match=f"precision={precision}: the model is itself one Linear"):
        policy.convert_module(nn.Linear(8, 1))
    converted = policy.convert_module(nn.Sequential(nn.Linear(8, 1)))  # inside a container it is converted
    assert type(converted[0]).__name__ != "Linear"


def test_the_start_lines_show_the_resolved_table(tmp_path, restore_argv, capsys):
    main(["train", "recipe=mlp", "recipe.hidden=32", "device=cpu", "train.console=plain", "train.steps=1",
          "precision=bf16", FIRST_AND_LAST, f"hydra.run.dir={tmp_path / 'run'}"])
    log = (tmp_path / "run" / "train.log").read_text()
    assert "rules=[match=0 run_in=fp32; match=9 run_in=fp32]" in log
    table = [line.split(" - ", 1)[1].strip() for line in log.splitlines() if " - " in line][1:9]
    # the columns that say the same of every layer said once below (weights; the converter, none here)
    assert table[0].split() == ["layer", "type", "compute", "rule"]
    assert table[1].split() == ["0", "Linear", "float32", "rules[0]"]
    assert table[2].split() == ["*", "x3", "LayerNorm", "as", "input", "mode"]
    assert table[3].split() == ["*", "x2", "Linear", "bfloat16", "mode"]
    assert table[4].split() == ["9", "Linear", "float32", "rules[1]"]
    assert table[5] == "weights: float32, every layer"


def test_a_format_rule_under_a_plain_mode_labels_the_runs_speed_as_an_emulations(tmp_path):
    rule = f"precision.rules=[{{match:'{HEAD}',run_in:mxfp4}}]"
    summary, _ = train_here(tmp_path, "precision=fp32", "train.steps=2", rule)
    assert summary["emulated"] is True and summary["converter"] is None


def test_an_mx_layer_inside_a_compiled_autocast_model_trains():
    """Inductor's CPU codegen (torch 2.14) fails to fuse the incoming half gradient's cast with its two blockings:
    such a layer runs outside the compiled graph (this shape failed with an AssertionError in try_loop_split)."""
    from ampctl.engine.precision.mx_emulated import MXEmulatedOptions, MXFormat, MXLinear

    torch.manual_seed(0)
    model = nn.Sequential(MXLinear.from_linear(nn.Linear(256, 768), config=MXEmulatedOptions(format=MXFormat.nvfp4),
                                               fmt="nvfp4"), nn.Linear(768, 8))
    x = torch.randn(8, 64, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(model)(x)
    out.float().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(x.detach())
    assert torch.equal(out, eager) and torch.isfinite(x.grad).all()


def test_a_ruled_model_is_honest_under_print_and_deepcopy():
    import copy

    cfg, policy, recipe = build("precision=bf16", f"precision.rules=[{{match:'{HEAD}',run_in:fp32}}]")
    with policy:
        model = build_state(cfg, policy, recipe).model
    assert f"({HEAD}): Linear(in_features=64, out_features=10, bias=True, run_in=fp32)" in repr(model)
    assert type(model[int(HEAD)]).__name__ == "Linear" and isinstance(model[int(HEAD)], nn.Linear)
    clone = copy.deepcopy(model)
    x = torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert clone(x).dtype == torch.float32  # the copy keeps the rule: its head computes in fp32
        with torch.no_grad():
            clone[int(HEAD)].weight.zero_()
            clone[int(HEAD)].bias.zero_()
        assert torch.equal(clone(x), torch.zeros(4, 10)) and not torch.equal(model(x), torch.zeros(4, 10))
    assert set(clone.state_dict()) == set(model.state_dict())


ZOO_MODES = [("fp32",), ("bf16",), ("fp16",), ("O1",), ("O2",), ("O3",), ("fp8_emulated",), ("mxfp8",),
             ("bf16", "precision.rules=[{type:norm,run_in:fp32}]"),
             ("fp16", "precision.rules=[{match:head,run_in:bf16},{match:conv,run_in:fp32}]"),
             ("O2", "precision.rules=[{type:norm,run_in:fp32},{match:head,run_in:fp32}]")]


@pytest.mark.parametrize("overrides", ZOO_MODES, ids=lambda o: " ".join(o))
def test_the_layer_table_says_what_forward_hooks_see_in_every_mode(overrides):
    check_the_layer_table_against_hooks(*overrides)




@pytest.mark.parametrize("overrides,expected", [
    (["precision=bf16"], {"0": "fp32", "2": "fp32"}),  # autocast's half layers
    (["precision=O2"], {"0": "fp32", "2": "fp32"}),  # cast to half
    (["precision=bf16", "precision.rules=[{match:'2',run_in:fp32}]"], {"0": "fp32", "2": None}),  # fp32 already
    (["precision=fp32"], {"0": None, "2": None}),  # nothing higher (tf32's the same: no rule takes TF32 away)
    (["precision=fp8_emulated"], {"0": "unconverted", "2": "unconverted"}),  # its format -> as the rest runs
    (["precision=fp8_emulated", "precision.rules=[{match:'2',run_in:bf16}]"], {"0": "unconverted", "2": "fp32"}),
])
def test_one_step_up_is_the_one_escalation_and_the_repair_take(overrides, expected):
    """PrecisionPolicy.one_step_up: escalation's raise and diff's repair's (search skips a layer it cannot raise),
    one answer for both."""
    from ampctl.studies.diffing.diff_repair import search

    _, policy, _ = build(*overrides)
    policy.convert_module(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1)))  # O2 keeps norms
    assert {layer: policy.one_step_up(layer) for layer in ("0", "2")} == expected
    measured: list[list[str]] = []

    def measure_with(rules):
        measured.append([f"{rule.match}->{rule.run_in}" for rule in rules])
        return type("Errors", (), {"gradient": type("Sums", (), {"rel_rms": 1.0})()})()

    search(["2", "0"], policy.one_step_up, 2, 0.1, measure_with, noise=1.0)
    raisable = [layer for layer in ("2", "0") if expected[layer] is not None]
    assert (measured[-1] if measured else []) == [f"{layer}->{expected[layer]}" for layer in raisable]  # all tried


def test_a_rule_counts_blocks_from_the_end_whatever_the_depth():
    """`blocks.-1.*`: the last block, as NVFP4's recipe keeps its last blocks high, resolved against the model's names
    (numerically: block 10 comes after block 9); an index beyond the blocks matches nothing and is refused."""
    from ampctl.conf.precision_schema import LayerRule

    names = ["", "blocks", *(f"blocks.{i}" for i in range(11)), *(f"blocks.{i}.mlp" for i in range(11)), "head"]

    def resolved(match: str) -> str:
        return LayerRule(run_in="bf16", match=match).counted_from_the_end(names).match

    assert resolved("blocks.-1.*") == "blocks.10.*" and resolved("blocks.-2.mlp") == "blocks.9.mlp"
    assert resolved("blocks.-12.*") == "blocks.-12.*" and resolved("head") == "head"
    gpt = ["recipe=gpt", "recipe.n_layers=3", "recipe.d_model=32", "recipe.n_heads=2", "recipe.block_size=16",
           "recipe.max_corpus_bytes=100000"]
    cfg, policy, recipe = build("precision=nvfp4_recipe", "precision.rules=[{match: 'blocks.-1.*', run_in: bf16}]",
                                base=gpt)
    with policy:
        build_state(cfg, policy, recipe)
    plan = policy.layer_plan
    assert plan.run_in("blocks.2.mlp.0") == plan.run_in("blocks.2.attn.qkv") == "bf16"  # the last block, decided
    assert plan.run_in("blocks.1.mlp.0") is None and plan.rules[0].match == "blocks.2.*"  # the others: the mode's
    converted = set(policy.layer_plan.converted)
    assert not any(name.startswith("blocks.2.") for name in converted)
    assert {"blocks.0.mlp.0", "blocks.1.mlp.0", "lm_head"} <= converted
    with pytest.raises(UsageError, match="blocks.-4"):
        cfg, policy, recipe = build("precision=nvfp4", "precision.rules=[{match: 'blocks.-4.*', run_in: bf16}]",
                                    base=gpt)
        with policy:
            build_state(cfg, policy, recipe)
