"""Overrides that several test modules run with."""

from __future__ import annotations

TINY_GPT = ["recipe=gpt", "recipe.d_model=32", "recipe.n_layers=2", "recipe.n_heads=2", "recipe.block_size=32",
            "recipe.batch_size=8", "recipe.max_corpus_bytes=200000"]

MODES = [
    ["precision=fp32"],
    ["precision=O0"],
    ["precision=fp16"],
    ["precision=O1"],
    ["precision=bf16"],
    ["precision=O2"],
    ["precision=O3"],
    ["precision=O1", "precision.dtype=bfloat16"],
    ["precision=O2", "precision.dtype=bfloat16"],
    ["precision=O3", "precision.dtype=bfloat16"],
]
