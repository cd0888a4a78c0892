"""gpt: a decoder-only transformer in the style of nanoGPT, byte-level, on a real text corpus (recipes/text.py:
the standard library's source by default, no download)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ampctl.errors import ConfigError
from ampctl.recipes.base import require_positive
from ampctl.recipes.metrics import classification_sums
from ampctl.recipes.text import BYTE_VOCAB_SIZE as VOCAB_SIZE
from ampctl.recipes.text import check_corpus_length, held_out_windows, read_corpus, split, token_windows


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, block_size: int, d_model: int, n_layers: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB_SIZE, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections.
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@dataclass
class GPTRecipe:
    corpus: Optional[str] = None
    max_corpus_bytes: int = 8_000_000
    block_size: int = 128
    batch_size: int = 16
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        require_positive(self, "block_size", "batch_size", "d_model", "n_layers", "n_heads", "max_corpus_bytes")
        if self.d_model % self.n_heads:
            raise ConfigError("recipe.n_heads", self.n_heads, f"a divisor of recipe.d_model ({self.d_model})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("recipe.dropout", self.dropout, "a number in [0, 1)")
        self.samples_per_batch = self.batch_size
        self.tokens_per_batch = self.batch_size * self.block_size
        self._data = read_corpus(self.corpus, self.max_corpus_bytes)
        check_corpus_length(self.corpus, len(self._data), self.block_size, max_corpus_bytes=self.max_corpus_bytes)

    def activation_checkpoint_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)  # type: ignore[arg-type]

    def build_model(self) -> nn.Module:
        return GPT(self.block_size, self.d_model, self.n_layers, self.n_heads, self.dropout)

    def _tokens(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self._data), dtype=torch.uint8)

    def batches(self, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return token_windows(split(self._tokens())[0], self.block_size, self.batch_size, device, seed)

    def eval_batches(self, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return held_out_windows(split(self._tokens())[1], self.block_size, self.batch_size, device)

    def eval_metrics(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        idx, targets = batch
        return classification_sums(model(idx), targets)  # per token: loss, next-token accuracy

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        idx, targets = batch
        logits = model(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
