"""The pieces of NVFP4's training recipe (NVIDIA, *Pretraining Large Language Models with NVFP4*, arXiv 2509.25149;
Transformer Engine's NVFP4BlockScaling; torchao's prototype.moe_training.nvfp4_training), emulated on any machine:

- 2D weight blocks: one E4M3 scale per 16x16 block of a weight, so that the forward's W and the input gradient's
  W^T hold the same quantized values (1D blocks along each GEMM's reduction dimension give the two different ones).
- Random Hadamard transforms (RHT) on the weight gradient's two inputs: each run of 16 values along the tokens
  multiplied by R = diag(signs) @ H16 / 4 (torchao's get_rht_matrix), which is orthogonal, so that
  (dY^T R)(X^T R)^T = dY^T X: without quantization the weight gradient is unchanged, and a block's outlier (an
  attention sink's token) is spread over its 16 values before they are quantized.
- Stochastic rounding of gradients to E2M1: a value between two neighbours rounds up with the probability of its
  distance from the lower one (unbiased: its expectation is the value). Round-to-nearest everywhere else.

The random bits come from a generator of their own seeded with a key hashed (lowbias32) from train.seed (the seed
torch was seeded with when the model was built), the layer's name, the training step and the call within it: reruns
are bit-identical (on the same kind of device) and under train.deterministic, every rank draws alike, and a resumed
run draws what the uninterrupted one would have. The sign vector is one for the whole model, from the same seed.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch
import torch.nn.functional as F

HADAMARD_SIZE = 16
WEIGHT_TILE = 16  # 2D weight blocks are 16x16
_MASK32 = 0xFFFFFFFF


def hadamard16(device: Optional[torch.device] = None) -> torch.Tensor:
    """The 16x16 Hadamard matrix of Sylvester's construction, scaled by 1/sqrt(16) (orthonormal), in fp32."""
    h = torch.ones(1, 1)
    while h.shape[0] < HADAMARD_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / 4.0).to(device)


def rht_matrix(signs: torch.Tensor) -> torch.Tensor:
    """diag(signs) @ H16 / 4 in fp32 (torchao's get_rht_matrix): orthogonal, R @ R^T = I."""
    return signs.float().reshape(-1, 1) * hadamard16(signs.device)


def sign_vector(seed: int) -> torch.Tensor:
    """16 signs (+1 / -1, fp32) drawn from `seed`: the model's one sign vector."""
    bits = torch.tensor([_hash32(seed ^ (0x5EED << 8) ^ i) for i in range(HADAMARD_SIZE)])
    return torch.where(bits & 1 == 1, 1.0, -1.0)


def rht_along_columns(matrix: torch.Tensor, rht: torch.Tensor) -> torch.Tensor:
    """matrix (rows, M) with each run of 16 columns multiplied by R, M zero-padded to a multiple of 16 (the padded
    columns are kept: both operands of a GEMM are transformed alike, and the product over the padded length is the
    product over the original one, R being orthogonal)."""
    rows, m = matrix.shape
    pad = (-m) % HADAMARD_SIZE
    padded = F.pad(matrix.float(), (0, pad)) if pad else matrix.float()
    return (padded.reshape(rows, -1, HADAMARD_SIZE) @ rht).reshape(rows, -1)


def _hash32(x: int) -> int:
    """lowbias32 (C. Wellons), a 32-bit integer hash with full avalanche."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    x ^= x >> 16
    return x


def draw_key(*parts: int) -> int:
    """One 32-bit key from integers (a seed, a layer's id, a step, a call), each hashed into the last."""
    key = 0x9E3779B9
    for part in parts:
        key = _hash32(key ^ _hash32(part & _MASK32) ^ _hash32((part >> 32) & _MASK32))
    return key


def layer_id(name: str) -> int:
    """A layer's name as a stable 32-bit integer (its draws are its own)."""
    return zlib.crc32(name.encode())


def uniforms(shape: torch.Size, key: int, device: torch.device) -> torch.Tensor:
    """Uniform fp32 values in [0, 1), one per element, from the device's generator seeded with the key (a seeded
    generator of its own: the global random state, dropout's, is left alone; 7x faster on a CPU than a hash of the
    elements' indices in int64 ops)."""
    generator = torch.Generator(device=device).manual_seed(key)
    return torch.rand(shape, generator=generator, device=device)


def stochastic_round_e2m1(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """x (fp32, within [-6, 6]) rounded to one of its two neighbouring E2M1 values, up with the probability of its
    distance from the lower one: u < (|x| - lower) / step. NaN stays NaN."""
    a = x.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    lower = torch.floor(a / step) * step
    up = u < (a - lower) / step
    return torch.copysign(lower + up * step, x)


def tiles(matrix: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """matrix (rows, cols) in fp32, zero-padded to multiples of 16 both ways, as (rows/16, cols/16, 256): each 16x16
    tile one block of 256 values, in the tile's row-major order."""
    rows, cols = matrix.shape
    padded = F.pad(matrix.float(), (0, (-cols) % WEIGHT_TILE, 0, (-rows) % WEIGHT_TILE))
    r, c = padded.shape[0] // WEIGHT_TILE, padded.shape[1] // WEIGHT_TILE
    blocks = padded.reshape(r, WEIGHT_TILE, c, WEIGHT_TILE).permute(0, 2, 1, 3).reshape(r, c, WEIGHT_TILE**2)
    return blocks, (rows, cols)


def untiles(blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """tiles' inverse: (rows/16, cols/16, 256) back to (rows, cols), the padding dropped."""
    r, c, _ = blocks.shape
    matrix = blocks.reshape(r, c, WEIGHT_TILE, WEIGHT_TILE).permute(0, 2, 1, 3).reshape(r * WEIGHT_TILE, -1)
    return matrix[:shape[0], :shape[1]]
