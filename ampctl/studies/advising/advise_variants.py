"""The ways `ampctl advise`'s comparison runs each mode: compiled too where compile is a candidate; where memory is
the goal, with and without activation checkpointing and with 8-bit AdamW states; each choice it does not make said
as a note."""

from __future__ import annotations

from omegaconf import DictConfig, open_dict


def compile_is_candidate(cfg: DictConfig, run_overrides: list[str], notes: list[str]) -> bool:
    """Whether compile is to be measured (the budget decides later where advise.compile is null)."""
    set_by_hand = any(o.lstrip("+~").startswith("train.compile.enabled=") for o in run_overrides)
    if cfg.compare.compile is not None or set_by_hand:
        notes.append("torch.compile: as set (compare.compile or train.compile.enabled), not chosen by advise")
        return False
    if cfg.advise.compile is False:
        notes.append("torch.compile: not measured (advise.compile=false)")
        return False
    return True


def with_variants(cfg: DictConfig, run_overrides: list[str], notes: list[str], compiled_too: bool = False,
                   ) -> DictConfig:
    """The ways compare runs each mode: eager and compiled where compile is a candidate (the budget may drop the
    compiled ones later); where memory is the goal, with and without activation checkpointing (where the recipe
    names blocks to checkpoint) and with the run's AdamW and 8-bit AdamW states; otherwise a note of why not."""
    if compiled_too:
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.compare.compile = [False, True]
    if cfg.advise.goal.value == "memory":
        cfg = with_optimizer_states(cfg, run_overrides, notes)
    if cfg.compare.activation_checkpointing is not None or any(
            o.lstrip("+~").startswith("train.activation_checkpointing=") for o in run_overrides):
        notes.append("activation checkpointing: as set (compare.activation_checkpointing or "
                     "train.activation_checkpointing), not chosen by advise")
        return cfg
    if cfg.advise.goal.value != "memory":
        notes.append("activation checkpointing: not measured: it trades compute for memory (it runs each "
                     "checkpointed block's forward twice), which goal=speed does not ask for; advise.goal=memory "
                     "measures it")
        return cfg
    from ampctl.recipes.base import build_recipe
    from ampctl.reports.plots import recipe_label

    if getattr(build_recipe(cfg.recipe), "activation_checkpoint_blocks", None) is None:
        notes.append(f"activation checkpointing: not measured: recipe {recipe_label(cfg)} names no blocks to "
                     "checkpoint")
        return cfg
    out = cfg.copy()
    with open_dict(out):
        out.compare.activation_checkpointing = [False, True]
    return out


# goal=memory: the optimizer whose states advise weighs beside the run's AdamW (torchao's, 2 bytes a parameter
# instead of 8: engine/optimizer_states.py)
LEANER_ADAMW = "adamw_8bit"


def with_optimizer_states(cfg: DictConfig, run_overrides: list[str], notes: list[str]) -> DictConfig:
    """goal=memory: the run's AdamW and AdamW with 8-bit states, each a row of the comparison, where torchao is
    installed and neither the optimizer nor compare.optimizers was chosen; otherwise a note of why not."""
    import importlib.util

    if cfg.compare.optimizers is not None or any(o.lstrip("+~").split("=")[0] == "optimizer" for o in run_overrides):
        notes.append("optimizer states: as chosen (optimizer= or compare.optimizers), not chosen by advise")
        return cfg
    if cfg.optimizer._target_ != "torch.optim.AdamW" or importlib.util.find_spec("torchao") is None:
        notes.append(f"optimizer states: not measured: optimizer={LEANER_ADAMW} (torchao's 8-bit AdamW states) needs "
                     "the run's optimizer to be AdamW and torchao installed (pip install 'ampctl[torchao]')")
        return cfg
    out = cfg.copy()
    with open_dict(out):
        out.compare.optimizers = ["adamw", LEANER_ADAMW]
    return out
