"""moe: the built-in GPT (recipes/gpt.py) with each block's MLP a mixture of experts, as torchtitan, DeepSeek-V3 and
Qwen3-MoE build theirs: a router (a linear gate, softmax or sigmoid scores, each token's top-k experts and their
weights), the experts as grouped weights that torch's grouped GEMM runs over the tokens sorted by expert (dropless:
every token reaches its k experts; or with a capacity, the pairs past it dropped), an optional shared expert every
token goes through, and a load-balancing loss or DeepSeek-V3's auxiliary-loss-free balance (a bias per expert, moved
after each step toward the experts given less). The routers are kept in fp32 by a rule of the model's own, after the
mode's (a top-k is discontinuous: a small error sends a token to another expert), which a rule of the user's on a
router replaces."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ampctl.conf.precision_schema import LayerRule
from ampctl.errors import ConfigError
from ampctl.recipes.gpt import GPT, GPTRecipe
from ampctl.recipes.metrics import classification_sums

SCORES = ("softmax", "sigmoid")
GROUPED_MM_ALIGNMENT = 16  # torch's grouped GEMM wants each row's stride a multiple of 16 bytes (8 bf16 values)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x's rows (sorted by expert; expert e's end at offsets[e]) times weight[e]ᵀ, weight (experts, out, in). Under
    autocast in autocast's dtype, as autocast runs a Linear: torch's autocast leaves grouped_mm in the dtype it is
    given on a CPU (torch 2.14's op lists), so the cast is done here, where it would otherwise run in fp32."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
    return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


def looped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """grouped_matmul one expert at a time (recipe.grouped_mm=false: the reference, and the benchmark's other side)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
    parts = torch.split(x, counts)
    return torch.cat([part @ weight[e].transpose(0, 1) for e, part in enumerate(parts)])


class Router(nn.Module):
    """Token-choice top-k routing. Its gate is an nn.Linear (`<block>.mlp.router.gate`: a rule names it, a converter
    may convert it); the scores are computed in fp32, as practice computes them (torchtitan, DeepSeek-V3). With
    bias_balance, DeepSeek-V3's expert bias: added to the scores to choose each token's experts, not to their
    weights (a buffer: in the state_dict, so a checkpoint resumes it; MoE.ampctl_after_step moves it)."""

    ampctl_router = True  # `ampctl diff` counts the tokens its top-k sends elsewhere (analysis/routing.py)

    def __init__(self, d_model: int, experts: int, top_k: int, score: str, route_norm: bool,
                 bias_balance: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, experts, bias=False)
        self.top_k, self.score, self.route_norm = top_k, score, route_norm
        self.expert_bias: Optional[torch.Tensor]
        self.register_buffer("expert_bias", torch.zeros(experts) if bias_balance else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, d_model) -> (every expert's score per token, the top-k weights, their experts)."""
        logits = self.gate(x).float()
        scores = torch.softmax(logits, dim=-1) if self.score == "softmax" else torch.sigmoid(logits)
        if self.expert_bias is None:
            weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        else:
            chosen = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
            weights = scores.gather(-1, chosen)
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return scores, weights, chosen


class GroupedExperts(nn.Module):
    """`experts` SwiGLU experts as three grouped weights in torchtitan's layout (experts, out, in): w1 and w3
    (experts, hidden, d_model), w2 (experts, d_model, hidden). Each grouped matmul goes through `grouped`, which a
    converter replaces (engine/precision/grouped_experts.py: FP8 and MX formats on the experts)."""

    ampctl_grouped_experts = True  # its grouped matmuls are `grouped`'s: a converter may compute them in a format
    ampctl_under_autocast = "lower"  # its matmuls run in autocast's dtype (grouped_matmul casts for autocast)

    def __init__(self, experts: int, d_model: int, hidden: int, grouped_mm: bool = True) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(experts, d_model, hidden))
        self.grouped_mm = grouped_mm

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_e @ weight[e]ᵀ for each expert e's rows of x (counts[e] of them, in expert order)."""
        if self.grouped_mm:
            return grouped_matmul(x, weight, torch.cumsum(counts, dim=0, dtype=torch.int32))
        return looped_matmul(x, weight, counts.tolist())  # the loop needs the counts on the host: a sync

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: the tokens sorted by expert, counts[e] of them expert e's."""
        gate = F.silu(self.grouped(x, self.w1, counts)) * self.grouped(x, self.w3, counts)
        return self.grouped(gate, self.w2, counts)


@dataclass(frozen=True)
class MoESpec:
    """What a MoE layer is (MoERecipe's keys of the same names)."""

    experts: int
    top_k: int
    hidden: int  # each expert's SwiGLU width
    shared: int = 0  # shared experts: a dense one of hidden x shared every token goes through
    score: str = "softmax"  # softmax | sigmoid
    route_norm: bool = True
    grouped: bool = True  # false: the experts one at a time
    bias_update_speed: float = 0.0  # DeepSeek-V3's expert bias (0: none)
    capacity_factor: Optional[float] = None  # None: dropless


class MoE(nn.Module):
    """A block's mixture of experts in place of its MLP. After each forward: `load`, the tokens each expert got
    (on the device: read on log steps only), and `balance_loss`, the Switch Transformer's load-balancing loss
    experts x sum_e f_e P_e (f_e: the share of routed tokens expert e got; P_e: its mean normalized score), 1 when
    balanced. With capacity_factor, each expert takes at most ceil(capacity_factor x tokens x top_k / experts) of a
    forward's (token, k) pairs, first come first served in token order (GShard, Switch); a dropped pair adds nothing
    to its token's output (the residual carries the token on), and `dropped_per_expert` counts it."""

    ampctl_experts = True  # its load is read over training (analysis/expert_load.py): tokens_per_expert

    def __init__(self, d_model: int, spec: MoESpec) -> None:
        super().__init__()
        experts = spec.experts
        self.experts_count, self.top_k, self.bias_update_speed = experts, spec.top_k, spec.bias_update_speed
        self.capacity_factor = spec.capacity_factor
        # the tokens each expert was sent by the training forwards since it was last read, on the device (a buffer:
        # it moves with the model; not persistent: a checkpoint does not need it). Integers: a model cast to half
        # (O2, bf16_true) casts its floating buffers too, and bf16 counts exactly only to 256.
        self.register_buffer("tokens_per_expert", torch.zeros(experts, dtype=torch.long), persistent=False)
        # the tokens of this optimizer step's forwards, for the expert bias's move after it (zero between steps)
        self.register_buffer("tokens_this_step",
                             torch.zeros(experts, dtype=torch.long) if spec.bias_update_speed else None,
                             persistent=False)
        # the pairs each expert dropped past its capacity since the load was last read (with tokens_per_expert)
        self.register_buffer("dropped_per_expert",
                             torch.zeros(experts, dtype=torch.long) if spec.capacity_factor is not None else None,
                             persistent=False)
        self.router = Router(d_model, experts, spec.top_k, spec.score, spec.route_norm,
                             bias_balance=spec.bias_update_speed > 0)
        self.experts = GroupedExperts(experts, d_model, spec.hidden, spec.grouped)
        width = spec.hidden * spec.shared
        self.shared = (nn.Sequential(nn.Linear(d_model, width), nn.GELU(), nn.Linear(width, d_model)) if spec.shared
                       else None)
        self.load: Optional[torch.Tensor] = None
        self.balance_loss: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        scores, weights, chosen = self.router(tokens)
        flat = chosen.reshape(-1)
        counts = torch.bincount(flat, minlength=self.experts_count)
        order = torch.argsort(flat, stable=True)  # the (token, k) pairs sorted by expert, ties in token order
        dispatched = tokens[order // self.top_k]
        kept = None
        if self.capacity_factor is not None:
            kept, dropped = self._within_capacity(flat, order, counts)
            # the dropped rows stay (their number is the counts': no host read) as zeros, which neither move a
            # format's scales nor give the experts an output or a gradient
            dispatched = dispatched * kept.unsqueeze(-1).to(dispatched.dtype)
        routed = self.experts(dispatched, counts)
        if kept is not None:
            routed = routed * kept.unsqueeze(-1).to(routed.dtype)
        # back to (token, k) order by the inverse permutation (a gather: deterministic, no atomic adds)
        unsorted = routed[torch.argsort(order)].view(tokens.shape[0], self.top_k, -1)
        out = (unsorted * weights.unsqueeze(-1).to(unsorted.dtype)).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared(tokens)
        self.load = counts.detach()
        if self.training:
            self.tokens_per_expert += self.load
            if self.tokens_this_step is not None:
                self.tokens_this_step += self.load
            if kept is not None:
                self.dropped_per_expert += dropped
        share = counts.to(scores.dtype) / flat.numel()
        mean_score = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)
        self.balance_loss = self.experts_count * (share * mean_score).sum()
        return out.view(shape).to(x.dtype)

    def _within_capacity(self, flat: torch.Tensor, order: torch.Tensor,
                         counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(which sorted pairs each expert keeps: its first `capacity` in token order; the pairs each dropped)."""
        capacity = math.ceil(self.capacity_factor * flat.numel() / self.experts_count)  # from shapes: no sync
        starts = torch.cumsum(counts, dim=0) - counts
        rank = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]  # place in its expert's queue
        return rank < capacity, counts - counts.clamp(max=capacity)


    @torch.no_grad()
    def ampctl_after_step(self) -> None:
        """After each optimizer step (the loop calls it; a skipped step too: its tokens were routed), DeepSeek-V3's
        update: each expert's bias moves by bias_update_speed toward the mean load, up where the step gave it fewer
        tokens than the mean, down where more; centered, as torchtitan centers it (the same choices, a bias that
        does not drift). Under DDP/FSDP the load is every rank's, summed, so the ranks' biases stay equal. The
        sign of a count is unchanged by activation checkpointing's second forward."""
        if self.tokens_this_step is None:
            return
        load = self.tokens_this_step.float()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(load)
        delta = self.bias_update_speed * torch.sign(load.mean() - load)
        self.router.expert_bias += delta - delta.mean()
        self.tokens_this_step.zero_()


def moe_layers(model: nn.Module) -> list[MoE]:
    return [module for module in model.modules() if isinstance(module, MoE)]


def balance_loss(model: nn.Module) -> torch.Tensor:
    """The mean of the model's MoE layers' load-balancing losses of their last forward, taken from them (a layer
    holds no graph past its loss: a copy of the model, an evaluation, do not keep it alive)."""
    losses = []
    for layer in moe_layers(model):
        if layer.balance_loss is not None:
            losses.append(layer.balance_loss)
            layer.balance_loss = None
    return torch.stack(losses).mean()


ROUTERS_IN_FP32 = [LayerRule(run_in="fp32", type="Router")]  # the model's own rule, after the mode's


class MoEGPT(GPT):
    """GPT with each block's MLP a MoE. `ampctl_rules`: rules of the model's own, applied after the mode's rules to
    the layers no rule of the mode decides (engine/precision/policy.py's with_model_rules)."""

    ampctl_rules = ROUTERS_IN_FP32

    def __init__(self, block_size: int, d_model: int, n_layers: int, n_heads: int, dropout: float,
                 moe: MoESpec) -> None:
        super().__init__(block_size, d_model, n_layers, n_heads, dropout)
        for block in self.blocks:
            block.mlp = MoE(d_model, moe)
        std = 0.02 / (2 * n_layers) ** 0.5  # GPT-2's scaled init of what adds to the residual stream
        for layer in moe_layers(self):
            nn.init.normal_(layer.router.gate.weight, std=0.02)
            nn.init.normal_(layer.experts.w1, std=0.02)
            nn.init.normal_(layer.experts.w3, std=0.02)
            nn.init.normal_(layer.experts.w2, std=std)
            if layer.shared is not None:
                for linear in (layer.shared[0], layer.shared[2]):
                    nn.init.normal_(linear.weight, std=0.02 if linear is layer.shared[0] else std)
                    nn.init.zeros_(linear.bias)


@dataclass
class MoERecipe(GPTRecipe):
    d_model: int = 128
    experts: int = 8
    top_k: int = 2
    expert_hidden: int = 256  # each expert's SwiGLU width
    shared_experts: int = 0  # a dense expert every token goes through (its width: shared_experts x expert_hidden)
    score: str = "softmax"  # softmax | sigmoid
    route_norm: bool = True  # the top-k weights normalized to sum to 1
    balance_coeff: float = 0.01  # the load-balancing loss's weight in the loss
    # DeepSeek-V3's auxiliary-loss-free balance: each step, every expert's routing bias moves by this (its gamma,
    # 0.001 in the paper) toward the mean load; 0: none. Usually with balance_coeff=0 (or a small one)
    bias_update_speed: float = 0.0
    # each expert's capacity, as a multiple of its share of a forward's (token, k) pairs; the pairs past it are
    # dropped (their share in experts.jsonl); null: dropless, every token reaches its k experts
    capacity_factor: Optional[float] = None
    grouped_mm: bool = True  # false: the experts one at a time (a loop, as a reference)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.experts < 2:
            raise ConfigError("recipe.experts", self.experts, "an integer >= 2")
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError("recipe.top_k", self.top_k, f"an integer in [1, recipe.experts={self.experts}]")
        for key in ("d_model", "expert_hidden"):
            if getattr(self, key) < 1 or getattr(self, key) % GROUPED_MM_ALIGNMENT:
                raise ConfigError(f"recipe.{key}", getattr(self, key),
                                  f"a positive multiple of {GROUPED_MM_ALIGNMENT} (torch's grouped GEMM aligns rows "
                                  "to 16 bytes)")
        if self.shared_experts < 0:
            raise ConfigError("recipe.shared_experts", self.shared_experts, "an integer >= 0")
        if self.score not in SCORES:
            raise ConfigError("recipe.score", self.score, " | ".join(SCORES))
        if self.capacity_factor is not None and not self.capacity_factor > 0.0:
            raise ConfigError("recipe.capacity_factor", self.capacity_factor, "a number > 0, or null (dropless)")
        for key in ("balance_coeff", "bias_update_speed"):
            if not getattr(self, key) >= 0.0:
                raise ConfigError(f"recipe.{key}", getattr(self, key), "a number >= 0")

    def build_model(self) -> nn.Module:
        moe = MoESpec(self.experts, self.top_k, self.expert_hidden, self.shared_experts, self.score, self.route_norm,
                      self.grouped_mm, self.bias_update_speed, self.capacity_factor)
        return MoEGPT(self.block_size, self.d_model, self.n_layers, self.n_heads, self.dropout, moe)

    def eval_metrics(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        idx, targets = batch
        return classification_sums(model(idx), targets)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The next-token cross-entropy, plus balance_coeff x the layers' mean load-balancing loss."""
        idx, targets = batch
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return loss + self.balance_coeff * balance_loss(model) if self.balance_coeff else loss
