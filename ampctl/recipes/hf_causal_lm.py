"""hf_causal_lm: a Hugging Face transformers causal language model (GPT-2, Llama, Mistral, Qwen2, Gemma, ...) built
from the library's own config class, randomly initialised (no download), trained on next-token prediction over a
local text corpus (recipes/text.py: the standard library's source by default).

transformers is an optional extra (`pip install 'ampctl[transformers]'`), imported when this recipe is chosen.
recipe.size=small keeps the library's proportions at a laptop's scale (a few million parameters); size=library
is the config class's own defaults (Llama: 7B). recipe.config.<field> sets any field of the config class over
either, and a field the class lacks is refused (transformers would keep it silently). The blocks the runner
checkpoints, compiles and wraps under FSDP are the model's own no-split modules (its decoder layers).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ampctl.conf.messages import did_you_mean
from ampctl.conf.precision_schema import LayerRule
from ampctl.errors import ConfigError, UsageError
from ampctl.recipes.base import plain_dict, require_positive
from ampctl.recipes.libraries import import_library, library_calls
from ampctl.recipes.metrics import classification_sums
from ampctl.recipes.text import (
    BYTE_VOCAB_SIZE,
    check_corpus_length,
    held_out_windows,
    read_corpus,
    split,
    token_windows,
)

SIZES = ("small", "library")
ATTENTION = ("sdpa", "eager")
# size=small: these widths and depths; the feed-forward width and the key/value heads keep the library's ratios
SMALL = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4}
FFN_FIELDS = ("intermediate_size", "ffn_dim", "n_inner")  # the feed-forward width, by its name in each family
SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id")
# named in the message for an unknown model_type (transformers has nearly 200)
WELL_KNOWN_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "opt", "gpt_neox")


RECIPE = "recipe=hf_causal_lm"
ROUTERS_IN_FP32 = [LayerRule(run_in="fp32", type="*TopKRouter")]  # transformers' MoE routers: as recipe=moe keeps its


def import_transformers() -> Any:
    return import_library("transformers", RECIPE, extra="transformers")


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def config_fields(config_class: type) -> set[str]:
    """The fields a config class takes: its constructor's arguments, what a default instance holds, and the
    generic names it maps to its own (GPT-2's hidden_size is n_embd)."""
    names = set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    if dataclasses.is_dataclass(config_class):
        names |= {f.name for f in dataclasses.fields(config_class)}
    names |= set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
    return names


def small_sizes(default: Any, chosen: dict[str, Any]) -> dict[str, Any]:
    """size=small for one config class: SMALL, then the widths the user did not choose derived from the ones
    chosen with the library's ratios: the feed-forward width (Llama's 11008/4096), the key/value heads
    (Mistral's 8 of 32), and a head dimension of hidden/heads where the class has one."""
    generic = {getattr(default, "attribute_map", {}).get(key, key): key for key in SMALL}  # n_embd -> hidden_size
    sizes = {key: chosen.get(key, chosen.get(own, SMALL[key])) for own, key in generic.items()}
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    for name in FFN_FIELDS:
        width = getattr(default, name, None)
        if isinstance(width, int):  # GPT-2's n_inner is None: 4 x hidden
            sizes[name] = max(1, round(width / default.hidden_size * hidden / 16)) * 16
    kv_heads = getattr(default, "num_key_value_heads", None)
    if isinstance(kv_heads, int):
        sizes["num_key_value_heads"] = max(1, kv_heads * heads // default.num_attention_heads)
    if isinstance(getattr(default, "head_dim", None), int):
        sizes["head_dim"] = hidden // heads
    sizes.update(chosen)
    for own, key in generic.items():
        if own != key and own in chosen:  # the class's own name was given: not the generic one too
            del sizes[key]
    return sizes


@functools.lru_cache(maxsize=2)
def tokenize(tokenizer_dir: Optional[str], corpus: Optional[str], max_bytes: int) -> torch.Tensor:
    """The corpus as token ids: its bytes, or a local tokenizer's ids (once per process: the recipe is built
    more than once)."""
    text = read_corpus(corpus, max_bytes)
    if tokenizer_dir is None:
        return torch.frombuffer(bytearray(text), dtype=torch.uint8)
    tokenizer = load_tokenizer(tokenizer_dir)
    ids = tokenizer(text.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int32 if len(tokenizer) < 2**31 else torch.int64)


@functools.lru_cache(maxsize=2)
def load_tokenizer(path: str) -> Any:
    transformers = import_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(Path(path).expanduser()), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UsageError(f"recipe.tokenizer={path!r} holds no tokenizer transformers can load "
                         f"({str(exc).strip().splitlines()[0]}); give a local directory saved by "
                         "tokenizer.save_pretrained(), or null for bytes") from None


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _fields_text(fields: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{key}: {value!r}" for key, value in fields.items()) + "}"


@dataclass
class HFCausalLMRecipe:
    model_type: str = "llama"
    size: str = "small"
    config: dict = field(default_factory=dict)  # fields of the model type's config class, over size
    attn_implementation: str = "sdpa"
    tokenizer: Optional[str] = None  # a local tokenizer directory; null: bytes (a vocabulary of 256)
    corpus: Optional[str] = None
    max_corpus_bytes: int = 8_000_000
    block_size: int = 128
    batch_size: int = 16

    def __post_init__(self) -> None:
        with library_calls(RECIPE):
            self._check()

    def _check(self) -> None:
        self.config = plain_dict(self.config)
        transformers = import_transformers()
        types = causal_lm_types()
        if self.model_type not in types:
            known = ", ".join(t for t in WELL_KNOWN_TYPES if t in types)
            raise UsageError(f"recipe.model_type={self.model_type!r}: no causal language model of that type in "
                             f"transformers {transformers.__version__}{did_you_mean(self.model_type, types)}; it "
                             f"has {len(types)}, among them {known} (all: transformers.models.auto.modeling_auto."
                             "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)")
        if self.size not in SIZES:
            raise ConfigError("recipe.size", self.size, " | ".join(SIZES))
        if self.attn_implementation not in ATTENTION:
            raise ConfigError("recipe.attn_implementation", self.attn_implementation, " | ".join(ATTENTION))
        require_positive(self, "block_size", "batch_size", "max_corpus_bytes")
        config_class = transformers.CONFIG_MAPPING[self.model_type]
        fields = config_fields(config_class)
        for key in self.config:
            if key not in fields:
                raise UsageError(f"recipe.config.{key}: {config_class.__name__} has no such field"
                                 f"{did_you_mean(str(key), sorted(fields), 'recipe.config.')}; see "
                                 f"transformers.{config_class.__name__} for its fields")
        self._config_class = config_class
        tokens = tokenize(self.tokenizer, self.corpus, self.max_corpus_bytes)
        check_corpus_length(self.corpus, tokens.numel(), self.block_size,
                            unit="bytes" if self.tokenizer is None else "tokens",
                            max_corpus_bytes=self.max_corpus_bytes)
        self.model_config = self._build_config()
        positions = getattr(self.model_config, "max_position_embeddings", None)
        if isinstance(positions, int) and positions < self.block_size:
            raise UsageError(f"recipe.block_size={self.block_size} is longer than the model's "
                             f"max_position_embeddings ({positions}); lower it or raise "
                             "+recipe.config.max_position_embeddings")
        self.samples_per_batch = self.batch_size
        self.tokens_per_batch = self.batch_size * self.block_size

    def _build_config(self) -> Any:
        """The config class built once with every field given (some classes derive fields in their
        constructor, as Qwen2's per-layer attention types from the depth)."""
        default = self._config_class()
        kwargs: dict[str, Any] = {}
        if self.size == "small" and hasattr(default, "max_position_embeddings"):
            kwargs["max_position_embeddings"] = self.block_size
        if self.tokenizer is None:
            kwargs["vocab_size"] = BYTE_VOCAB_SIZE
            # the library's special token ids lie outside a byte vocabulary (GPT-2's 50256): none, as in a
            # corpus of raw bytes
            kwargs.update({name: None for name in SPECIAL_TOKENS if hasattr(default, name)})
        else:
            tokenizer = load_tokenizer(self.tokenizer)
            kwargs["vocab_size"] = len(tokenizer)
            kwargs.update({name: getattr(tokenizer, name) for name in SPECIAL_TOKENS if hasattr(default, name)})
        needed = kwargs["vocab_size"]  # the token ids the corpus holds: the embedding must take every one
        kwargs.update(small_sizes(default, self.config) if self.size == "small" else self.config)
        if isinstance(kwargs.get("vocab_size"), int) and kwargs["vocab_size"] < needed:
            raise UsageError(f"recipe.config.vocab_size={kwargs['vocab_size']} is not allowed: expected an integer "
                             f">= {needed}, the " + ("byte vocabulary (256)" if self.tokenizer is None else
                                                     f"tokenizer's vocabulary ({needed})") + " the corpus is read in")
        try:
            return self._config_class(**kwargs)
        except Exception as exc:  # its validators' errors (huggingface_hub's strict dataclasses wrap ValueError)
            chosen = f" with recipe.config {_fields_text(self.config)}" if self.config else ""
            raise UsageError(f"recipe: {self._config_class.__name__} refused size={self.size}{chosen}: "
                             f"{_root_cause(exc)}") from None

    def build_model(self) -> nn.Module:
        transformers = import_transformers()
        try:
            with library_calls(RECIPE):
                model = transformers.AutoModelForCausalLM.from_config(self.model_config,
                                                                      attn_implementation=self.attn_implementation)
        except ValueError as exc:  # a size the architecture cannot take
            raise UsageError(f"recipe.model_type={self.model_type}: {_root_cause(exc)}") from None
        if any(type(m).__name__.endswith("TopKRouter") for m in model.modules()):  # a mixture of experts (Mixtral...)
            model.ampctl_rules = ROUTERS_IN_FP32  # its routers in fp32, after the mode's rules, as recipe=moe's
        return model

    def activation_checkpoint_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The model's no-split modules (its decoder layers), as transformers names them for device maps."""
        names = set(getattr(model, "_no_split_modules", None) or ())
        return [m for m in model.modules() if type(m).__name__ in names]

    def _tokens(self) -> torch.Tensor:
        return tokenize(self.tokenizer, self.corpus, self.max_corpus_bytes)

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return token_windows(split(self._tokens())[0], self.block_size, self.batch_size, device, seed)

    def eval_batches(self, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return held_out_windows(split(self._tokens())[1], self.block_size, self.batch_size, device)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        idx, targets = batch
        logits = model(input_ids=idx, use_cache=False).logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def eval_metrics(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        idx, targets = batch
        return classification_sums(model(input_ids=idx, use_cache=False).logits, targets)  # per token
