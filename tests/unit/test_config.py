"""Configs: every shipped YAML is typed by a schema, and every bad value is refused with its key."""

from __future__ import annotations

import json
import math
from importlib import resources

import pytest
import yaml
from omegaconf import OmegaConf

from ampctl.conf.schema import validate
from ampctl.errors import ConfigError
from tests.support.training import compose_cfg

CONF = resources.files("ampctl.conf")
CLOSED_GROUPS = ("precision", "scaler")


def yaml_files(group: str) -> list[str]:
    return sorted(p.name for p in CONF.joinpath(group).iterdir() if p.name.endswith(".yaml"))


@pytest.mark.parametrize("group", CLOSED_GROUPS)
def test_every_closed_group_yaml_extends_a_schema(group):
    # A YAML that forgets its schema silently accepts garbage; aliases extend a file that has one.
    for name in yaml_files(group):
        data = yaml.safe_load(CONF.joinpath(group, name).read_text())
        defaults = data.get("defaults", [])
        extends_schema = any(isinstance(d, str) and d.startswith(f"/schema_{group}") for d in defaults)
        alias_of = [d for d in defaults if isinstance(d, str) and f"{d}.yaml" in yaml_files(group)]
        assert extends_schema or alias_of, f"ampctl/conf/{group}/{name} extends no schema"


@pytest.mark.parametrize("name", [n.removesuffix(".yaml") for n in yaml_files("precision")])
def test_every_precision_mode_composes_and_validates(name):
    cfg = compose_cfg(f"precision={name}")
    validate(cfg)  # raises ConfigError on any bad value
    precision = OmegaConf.to_object(cfg.precision)  # the schema dataclass, its __post_init__ run
    assert type(precision).__name__ == "PrecisionConfig" and precision.name == cfg.precision.name


@pytest.mark.parametrize(
    "precision,scaler",
    [("fp32", "none"), ("O0", "none"), ("tf32", "none"), ("fp16", "dynamic"), ("O1", "dynamic"),
     ("bf16", "none"), ("O2", "dynamic"), ("O3", "static")],
)
def test_each_precision_mode_picks_its_default_scaler(precision, scaler):
    assert compose_cfg(f"precision={precision}").scaler.kind == scaler


def test_command_line_scaler_beats_the_precision_default():
    assert compose_cfg("precision=fp16", "scaler=none").scaler.kind == "none"
    assert compose_cfg("scaler=dynamic", "precision=bf16").scaler.kind == "dynamic"


def test_O3_is_static_one_as_apex():
    assert compose_cfg("precision=O3").scaler.scale == 1.0


@pytest.mark.parametrize(
    "override,key",
    [
        ("scaler.growth_factor=1.0", "scaler.growth_factor"),
        ("scaler.growth_factor=0.5", "scaler.growth_factor"),
        ("scaler.backoff_factor=1.0", "scaler.backoff_factor"),
        ("scaler.backoff_factor=0", "scaler.backoff_factor"),
        ("scaler.growth_interval=0", "scaler.growth_interval"),
        ("scaler.init_scale=0", "scaler.init_scale"),
        ("scaler.init_scale=-5", "scaler.init_scale"),
        ("scaler.min_scale=-1", "scaler.min_scale"),
        ("train.steps=0", "train.steps"),
        ("train.grad_accum_steps=0", "train.grad_accum_steps"),
        ("train.log_every=0", "train.log_every"),
        ("train.clip_grad_norm=0", "train.clip_grad_norm"),
        ("train.lr.min_ratio=2", "train.lr.min_ratio"),
        ("optimizer.lr=-1", "optimizer.lr"),
        ("precision.master_weights=true", "precision.master_weights"),
        ("precision.cast_model=true", "precision.cast_model"),
        ("scaler.hysteresis=0", "scaler.hysteresis"),
        ("train.checkpoint.every=0", "train.checkpoint.every"),
        ("train.checkpoint.every_s=0", "train.checkpoint.every_s"),
        ("train.checkpoint.every_s=inf", "train.checkpoint.every_s"),
        ("train.checkpoint.keep=0", "train.checkpoint.keep"),
        ("guard.max_consecutive_skips=0", "guard.max_consecutive_skips"),
        ("distributed.async_checkpoint=true", "distributed.async_checkpoint"),  # async saves are sharded ones
        ("train.compile.mode=fastest", "train.compile.mode"),
    ],
)
def test_out_of_range_values_name_key_and_allowed(override, key):
    precision = "precision=bf16" if override.startswith("precision.") else "precision=fp16"
    cfg = compose_cfg(precision, override)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert info.value.key == key
    assert "expected" in str(info.value)


@pytest.mark.parametrize("overrides,message", [
    # Apex would start at min(max_scale, init_scale); GradScaler would record 2^32 at step 1
    (["scaler.init_scale=4294967296", "scaler.max_scale=1048576"],
     "scaler.init_scale=4294967296.0 is not allowed: expected a value within [scaler.min_scale, scaler.max_scale] "
     "= [null, 1.04858e+06]"),
    (["scaler.init_scale=2", "scaler.min_scale=4"], "scaler.init_scale=2.0 is not allowed: expected a value within"),
    # 1/scale overflows fp32: the unscaled gradients would be inf * 0 = NaN, applied as a step
    (["scaler.init_scale=1e-45"], "scaler.init_scale=1e-45 is not allowed: expected a number in [2^-126, 3.4e38]"),
    (["scaler.init_scale=1e39"], "scaler.init_scale=1e+39 is not allowed: expected a number in [2^-126, 3.4e38]"),
    (["scaler.min_scale=1e-40"], "scaler.min_scale=1e-40 is not allowed: expected a number in [2^-126, 3.4e38]"),
    (["scaler=static", "scaler.scale=1e-40"], "scaler.scale=1e-40 is not allowed: expected a number in [2^-126"),
])
def test_loss_scales_outside_their_bounds_or_fp32_are_refused(overrides, message):
    cfg = compose_cfg("precision=O3", "scaler=dynamic", *overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert str(info.value).startswith(message)


def test_fsdp_checkpoints_are_sharded_and_may_be_saved_asynchronously():
    cfg = compose_cfg("distributed=fsdp", "distributed.async_checkpoint=true")
    validate(cfg)
    assert cfg.distributed.checkpoint_format.value == "sharded"
    assert compose_cfg("distributed=ddp").distributed.checkpoint_format.value == "full"
    validate(compose_cfg("distributed=ddp", "distributed.checkpoint_format=sharded",
                         "distributed.async_checkpoint=true", "distributed.async_checkpointer=process"))


@pytest.mark.parametrize("overrides,message", [
    (["distributed=fsdp", "distributed.async_checkpointer=process"],
     "distributed.async_checkpointer='process' is not allowed: expected thread unless "
     "distributed.async_checkpoint=true"),
    (["distributed.checkpoint_format=sharded", "distributed.async_checkpoint=true",
      "distributed.async_checkpointer=process"],
     "distributed.async_checkpointer='process' is not allowed: expected thread without a distributed run"),
])
def test_a_checkpointing_process_is_refused_where_there_is_no_async_distributed_save(overrides, message):
    with pytest.raises(ConfigError) as info:
        validate(compose_cfg(*overrides))
    assert str(info.value).startswith(message), str(info.value)


def test_loss_scales_at_the_edges_of_their_ranges_are_allowed():
    pinned = compose_cfg("precision=fp16", "scaler.init_scale=1024", "scaler.min_scale=1024", "scaler.max_scale=1024")
    smallest = compose_cfg("precision=fp16", f"scaler.init_scale={2.0**-126!r}")
    for cfg in (pinned, smallest):
        validate(cfg)  # raises ConfigError if refused
    assert OmegaConf.to_object(smallest.scaler).init_scale == 2.0**-126


def test_min_scale_above_max_scale_is_refused():
    cfg = compose_cfg("precision=fp16", "scaler.min_scale=1024", "scaler.max_scale=2")
    with pytest.raises(ConfigError, match="scaler.min_scale"):
        validate(cfg)


def test_run_records_are_strict_json(tmp_path):
    from ampctl import io
    from ampctl.reports.runs import load_run

    whole = {"skipped_total": 0, "final_loss_scale": 65536.0, "median_step_time_ms": 1.5}  # what report requires
    summary = {"final_loss": float("nan"), "tail_loss": float("inf"), "steps": 3, "nested": [float("-inf"), 1.5],
               **whole}
    io.write_json(tmp_path / "summary.json", summary)
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"final_loss": None, "tail_loss": None, "steps": 3, "nested": [None, 1.5], **whole}
    back = load_run(tmp_path).summary
    assert math.isnan(back["final_loss"]) and back["steps"] == 3  # read back as the number it stood for


def _schema_default(schema, dotted: str):
    """The default the schema dataclass gives dotted (descending into nested config dataclasses)."""
    import dataclasses
    import typing

    head, _, rest = dotted.partition(".")
    hints = typing.get_type_hints(schema)
    field = {f.name: f for f in dataclasses.fields(schema)}[head]
    if rest:
        nested = [t for t in (hints[head], *typing.get_args(hints[head])) if dataclasses.is_dataclass(t)]
        return _schema_default(nested[0], rest)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _schema_of(path: str):
    from ampctl.conf import schema as config
    from ampctl.shell.command import command_named

    group = path.split("/")[0] if "/" in path else None
    if group == "scaler":
        return config.SCALER_SCHEMAS[path.split("/")[1].removesuffix(".yaml")]
    return {"precision": config.PrecisionConfig, "distributed": config.DistributedConfig,
            None: {"run_defaults.yaml": config.AmpctlConfig, "train.yaml": config.AmpctlConfig,
                   **{f"{name}.yaml": command_named(name).schema for name in ("compare", "memory", "inspect")}
                   }.get(path)}.get(group)


def test_a_yaml_states_only_what_differs_from_its_schema():
    """The schema dataclasses are the one source of defaults: a YAML that repeats one can drift from it
    (TrainConfig and run_defaults.yaml once disagreed on clipping, the lr schedule and its warm-up)."""
    paths = ["run_defaults.yaml", "train.yaml", "compare.yaml", "memory.yaml", "inspect.yaml"]
    paths += [f"{group}/{name}" for group in ("precision", "scaler", "distributed") for name in yaml_files(group)]
    repeated = []
    for path in paths:
        schema = _schema_of(path)
        data = yaml.safe_load(CONF.joinpath(path).read_text()) or {}
        # precision.options is open: a converter mode's YAML lists every option (the test below)
        for key, value in _leaves({k: v for k, v in data.items() if k not in ("defaults", "hydra", "options")}):
            default = _schema_default(schema, key)
            default = getattr(default, "value", default)  # an Enum's YAML spelling
            if value == default and not (isinstance(value, dict) and not value):
                repeated.append(f"ampctl/conf/{path}: {key}: {value!r}")
    assert not repeated, "restated schema defaults:\n" + "\n".join(repeated)


def test_the_composed_defaults_are_the_schemas():
    cfg = compose_cfg()
    assert cfg.train.clip_grad_norm == 1.0 and cfg.train.lr.schedule.value == "cosine"
    assert cfg.train.lr.warmup_steps == 20 and cfg.scaler.kind == "none" and cfg.precision.name == "fp32"
    from ampctl.conf.train_schema import TrainConfig

    schema = TrainConfig()
    assert {k: getattr(v, "value", v) for k, v in cfg.train.items()} == {
        k: getattr(v, "value", v) for k, v in vars(schema).items()}


def test_the_range_checks_live_in_the_schema_dataclasses():
    """One place for a range: the dataclass refuses a bad value however it is built (Hydra, a test, a user's
    script), with the same one line that `ampctl train` prints."""
    from ampctl.conf.precision_schema import DynamicScalerConfig
    from ampctl.conf.train_schema import TrainConfig
    from ampctl.engine.precision.fp8_emulated import Fp8EmulatedOptions, Fp8Scaling
    from ampctl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^train.steps=0 is not allowed: expected an integer >= 1$"):
        TrainConfig(steps=0)
    with pytest.raises(ConfigError, match=r"^scaler.init_scale=8.0 is not allowed: expected a value within"):
        DynamicScalerConfig(init_scale=8.0, min_scale=16.0)
    with pytest.raises(ConfigError, match=r"^precision.options.format='hybrid'"):
        Fp8EmulatedOptions(scaling=Fp8Scaling.blockwise)


def test_a_key_the_schema_lacks_is_refused_even_when_added_with_plus():
    from ampctl.conf.typed import typed_config
    from ampctl.errors import UsageError

    cfg = compose_cfg("+train.stepz=5")  # Hydra's `+` adds the key past the struct flag
    assert cfg.train.stepz == 5
    with pytest.raises(UsageError, match=r"^train.stepz: no such key \(did you mean train.steps\?\); allowed: steps, "
                                         r"grad_accum_steps, "):
        typed_config(cfg)


@pytest.mark.parametrize("name", [p.stem for p in sorted((CONF / "logger").iterdir()) if p.name.endswith(".yaml")])
def test_a_trackers_yaml_names_its_class_with_every_option_at_its_default_and_its_extra_exists(name):
    """A tracker is its module and its YAML: the YAML's node names the Tracker subclass (`_target_`) and lists its
    options dataclass's every field at its default (an open node has only the keys its YAML names); the extra the
    class names is one pyproject.toml declares."""
    import dataclasses
    from importlib import metadata

    from omegaconf import OmegaConf

    from ampctl.runner.trackers import tracker_class

    node = OmegaConf.load(CONF / "logger" / f"{name}.yaml")[name]
    cls = tracker_class(name, node)
    defaults = OmegaConf.to_container(OmegaConf.structured(cls.options_type), enum_to_str=True)
    assert {k: v for k, v in OmegaConf.to_container(node).items() if k != "_target_"} == defaults
    assert [f.name for f in dataclasses.fields(cls.options_type)] == [k for k in node if k != "_target_"]
    if cls.package is not None:
        assert cls.extra in metadata.metadata("ampctl").get_all("Provides-Extra")


CONVERTER_MODES = [name for name in yaml_files("precision")
                   if "converter" in yaml.safe_load(CONF.joinpath("precision", name).read_text())]


@pytest.mark.parametrize("name", CONVERTER_MODES)
def test_a_converter_modes_yaml_lists_its_converters_every_option_at_its_default(name):
    """A converter mode is its converter's module and its YAML: precision.options lists every field of the
    converter's options dataclass (an open node has only the keys its YAML names), each at the dataclass's default
    but for what the mode itself is (mxfp4's format)."""
    from ampctl.engine.precision import converters

    data = yaml.safe_load(CONF.joinpath("precision", name).read_text())
    cls = converters.converter_class(data["converter"])
    defaults = OmegaConf.to_container(OmegaConf.structured(cls.options_type), enum_to_str=True)
    assert set(data["options"]) == set(defaults)
    differs = {key for key in defaults if data["options"][key] != defaults[key]}
    assert differs <= {"format"} and all(data["options"]["format"] == data["name"] for _ in differs)


def test_a_run_recorded_with_a_converters_own_options_node_is_read_with_them_as_precision_options():
    """Before precision.options, each built-in converter's options had a node of their own (fp8_emulated, mx,
    fp8_torchao; the others null): a run recorded then resumes with its options where they are now."""
    from ampctl.conf.typed import as_recorded_now, typed_config

    recorded = OmegaConf.to_container(compose_cfg("precision=mxfp4"))
    recorded["precision"] = {**{k: v for k, v in recorded["precision"].items() if k != "options"},
                             "fp8_emulated": None, "fp8_torchao": None, "mx": {**recorded["precision"]["options"]}}
    now = as_recorded_now(recorded)
    assert now["precision"]["options"]["format"] == "mxfp4" and "mx" not in now["precision"]
    assert "mx" in recorded["precision"]  # the record read, not changed
    assert typed_config(OmegaConf.create(now)).precision.options.scale_mode == "floor"


def test_the_keys_a_resume_may_change_are_the_schemas_marked_fields():
    """Marked where each field is declared (safe_to_change); the set is pinned because it is also what a run's
    identity hash leaves out: a change here makes every earlier run's checkpoints refuse to resume."""
    from ampctl.runner.identity import SAFE_TO_CHANGE

    assert set(SAFE_TO_CHANGE) == {
        "train.steps", "train.log_every", "train.console", "train.checkpoint.every", "train.checkpoint.every_s",
        "train.checkpoint.keep", "train.checkpoint.mirror", "train.cluster.preempt_signal",
        "train.cluster.slurm_requeue", "train.cluster.hang_after_s", "train.compile.enabled", "train.compile.mode",
        "train.threads", "train.hold_host_memory", "train.profile", "train.deterministic",
        "train.timing_warmup_steps", "train.eval.every",
        "train.eval.batches", "train.eval.fp32", "train.checkpoint.save_top_k", "telemetry.profile_cpu_memory",
        "guard.loss_spike", "guard.loss_spike_window", "guard.on_trip", "guard.max_escalations", "train.diff.",
        "precision.grad_accum_dtype", "precision.schedule", "train.checkpoint.mirror_options.",
        "distributed.", "logger.", "resume"}


@pytest.mark.parametrize("name", [p.stem for p in sorted((CONF / "recipe").iterdir()) if p.name.endswith(".yaml")])
def test_a_built_in_recipes_yaml_declares_its_dataclasss_fields_at_their_defaults(name):
    """A recipe node is open-ended (any `_target_`), so its keys exist only if its YAML names them: the YAML of a
    built-in recipe lists every field of the recipe's dataclass (to be overridden without `+`, shown by --cfg job
    and completion, without importing the recipe and torch to compose) at the dataclass's own default, the one
    source of the value; a variant (gpt2, resnet50) states only what differs from the recipe it extends."""
    import dataclasses

    from hydra.utils import get_class

    data = yaml.safe_load(CONF.joinpath("recipe", f"{name}.yaml").read_text())
    if "defaults" in data:  # a variant: what differs from its base
        base = yaml.safe_load(CONF.joinpath("recipe", f"{data['defaults'][0]}.yaml").read_text())
        stated = {k: v for k, v in data.items() if k != "defaults"}
        assert stated and all(k in base and base[k] != v for k, v in stated.items()), stated
        return
    fields = {f.name: f for f in dataclasses.fields(get_class(data.pop("_target_"))) if f.init}

    def default(f: dataclasses.Field):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    assert list(data) == list(fields)  # the dataclass's order, every field
    assert {k: v for k, v in data.items() if v != default(fields[k])} == {}
