"""Feed-forward blocks: MLP, gated linear units (SwiGLU, GeGLU), mixture of experts and DeepSeekMoE.

Projection names follow Hugging Face's Llama/Mixtral (``gate_proj``, ``up_proj``,
``down_proj``; the MoE router is ``router``, DeepSeekMoE's always-on experts ``shared_experts``),
so an importer maps weights by name. The MLP has
``up_proj`` and ``down_proj`` only. ``down_proj`` is the residual projection that
``yamlformer.blocks.init`` scales GPT-2 style.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from yamlformer.blocks import registry
from yamlformer.blocks.experts import SplitsExperts, StackedLinear, balance_statistics, dispatch
from yamlformer.blocks.linear import Linear

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # the exact erf form (BERT, the 2017 Transformer's successors)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2, Gemma
    "silu": F.silu,
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(ACTIVATIONS)}") from None


class MLP(nn.Module):
    """``down_proj(act(up_proj(x)))``."""

    def __init__(self, config, d_model: int):
        super().__init__()
        hidden_dim = config.resolved_hidden_dim(d_model)
        self.up_proj = Linear(d_model, hidden_dim, bias=config.bias)
        self.down_proj = Linear(hidden_dim, d_model, bias=config.bias)
        self.act = activation(config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GLU(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` (Shazeer 2020)."""

    def __init__(self, config, d_model: int):
        super().__init__()
        hidden_dim = config.resolved_hidden_dim(d_model)
        self.gate_proj = Linear(d_model, hidden_dim, bias=config.bias)
        self.up_proj = Linear(d_model, hidden_dim, bias=config.bias)
        self.down_proj = Linear(hidden_dim, d_model, bias=config.bias)
        self.act = activation(config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class GroupedExperts(nn.Module):
    """``n`` experts of one ``mlp`` or ``glu`` config with stacked weights (``gate_proj``,
    ``up_proj``, ``down_proj``, each a :class:`~yamlformer.blocks.experts.StackedLinear`: ``gate_proj.weight``
    is ``(n, hidden, d_model)``); ``forward(rows, counts)`` runs the first ``counts[0]`` rows
    through expert 0, the next ``counts[1]`` through expert 1..., each computing exactly what
    :class:`MLP` or :class:`GLU` computes. With ``clamp``, GPT-OSS's clamped SwiGLU: ``gate =
    min(gate_proj(x), limit)``, ``up = clamp(up_proj(x), -limit, limit)``, ``down_proj((up + 1) *
    gate * sigmoid(alpha * gate))`` (Hugging Face's ``GptOssExperts._apply_gate``, on separate gate
    and up projections). Each projection is one grouped matmul where torch has one for the
    rows' device and dtype (:func:`~yamlformer.blocks.experts.grouped_linear`; ``grouped_mm = False`` keeps
    the per-expert loop)."""

    def __init__(self, config, d_model: int, n: int, clamp=None):
        super().__init__()
        hidden = config.resolved_hidden_dim(d_model)
        self.gated = config.n_in_projections == 2
        if self.gated:
            self.gate_proj = StackedLinear(n, d_model, hidden, config.bias)
        self.up_proj = StackedLinear(n, d_model, hidden, config.bias)
        self.down_proj = StackedLinear(n, hidden, d_model, config.bias)
        self.act = activation(config.activation)
        self.clamp = (clamp.alpha, clamp.limit) if clamp is not None else None
        self.grouped_mm = True
        self.n_experts = n
        self._register_load_state_dict_pre_hook(self._stack_per_expert)

    def _stack_per_expert(self, state_dict, prefix, *args) -> None:
        """A checkpoint written before the experts were stacked (one module per expert,
        ``experts.{e}.up_proj.weight``) loads: its tensors are stacked under the stacked names."""
        for name, _ in self.named_parameters():
            old = [f"{prefix}{e}.{name}" for e in range(self.n_experts)]
            if f"{prefix}{name}" not in state_dict and all(key in state_dict for key in old):
                state_dict[f"{prefix}{name}"] = torch.stack([state_dict.pop(key) for key in old])

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        def project(layer, x):
            return layer(x, counts, self.grouped_mm)

        if self.clamp is not None:
            alpha, limit = self.clamp
            gate = project(self.gate_proj, rows).clamp(max=limit)
            up = project(self.up_proj, rows).clamp(min=-limit, max=limit)
            return project(self.down_proj, (up + 1) * (gate * torch.sigmoid(gate * alpha)))
        if self.gated:
            return project(self.down_proj, self.act(project(self.gate_proj, rows)) * project(self.up_proj, rows))
        return project(self.down_proj, self.act(project(self.up_proj, rows)))


class MoE(SplitsExperts, nn.Module):
    """Top-k mixture of experts (Switch, Mixtral) with sparse dispatch.

    The router (a linear layer) scores every expert; each token goes to its ``top_k`` experts
    with gates softmax-normalised over the chosen logits (equal to Mixtral's softmax over all
    experts, top-k, renormalise). Tokens are sorted by expert and each expert multiplies only
    its own rows (:func:`~yamlformer.blocks.experts.dispatch`), so the expert matmuls cover exactly
    ``top_k * tokens`` rows. The experts' weights are stacked (:class:`GroupedExperts`:
    ``experts.gate_proj.weight`` is ``(n_experts, hidden, d_model)``), as in torchtitan and
    transformers 5; the importers stack Hugging Face's per-expert or fused tensors.

    After each forward, ``aux_loss`` holds the Switch/Mixtral load-balancing loss
    ``n_experts * sum_e f_e * P_e`` (``f_e``: share of tokens routed to expert ``e``, counting
    every one of a token's ``top_k`` choices; ``P_e``: the mean router probability of ``e``),
    differentiable through ``P_e``. It is computed over every token of this forward's batch,
    padding included; under expert parallelism too (each rank's own micro-batch, as under data
    parallelism, where the ranks also read different batches).

    GPT-OSS: ``router_bias`` gives the router a bias, ``expert_bias`` the experts' projections
    theirs, and ``clamp`` makes each expert GPT-OSS's clamped SwiGLU. Expert parallelism splits
    the stacked experts (:class:`~yamlformer.blocks.experts.SplitsExperts`); the router stays whole.
    """

    def __init__(self, config, d_model: int):
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        # a plain nn.Linear, not an adaptable projection (yamlformer.blocks.linear): routing stays the base model's
        self.router = nn.Linear(d_model, config.n_experts, bias=config.router_bias)
        # with expert_bias the expert's bias is on (yamlformer.blocks.configs.ffn)
        self.experts = GroupedExperts(config.expert, d_model, config.n_experts, config.clamp)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (tokens, d_model)
        logits = self.router(flat)  # (tokens, n_experts)
        probs = torch.softmax(logits.float(), dim=-1)
        top_probs, top_experts = probs.topk(self.top_k, dim=-1)  # (tokens, top_k)
        gates = (top_probs / top_probs.sum(-1, keepdim=True)).to(x.dtype)
        out, counts = dispatch(flat, self.experts, self.n_experts, top_experts, gates, group=self.expert_group)

        counts, mean_probs, tokens = balance_statistics(counts.float(), probs, self.sequence_group)
        routed_share = counts / tokens  # f_e, summed over k
        self.aux_loss = self.n_experts * (routed_share * mean_probs).sum()
        return out.reshape(shape)


class DeepSeekMoE(SplitsExperts, nn.Module):
    """DeepSeekMoE: fine-grained routed experts plus shared experts, DeepSeek-V2/V3 routing.

    Routing, as DeepSeek's code and Hugging Face's ``DeepseekV2/V3TopkRouter`` compute it, in
    fp32: scores ``softmax`` or ``sigmoid`` of the router logits; for the choice only, plus
    ``expert_bias`` and, with groups, every expert outside the ``topk_groups`` best groups
    masked (a group ranks by its best score or its two best summed); the ``top_k`` best are
    chosen; their weights are the scores (renormalised with ``norm_topk_prob``) times
    ``routed_scaling_factor``; they multiply the experts' outputs, or with ``weight_on: input``
    their inputs (Llama 4's ``Llama4TextMoe``: top-1, sigmoid, plus a shared expert). The
    shared experts (one wide FFN) see every token. The routed
    experts' weights are stacked (:class:`GroupedExperts`: ``experts.gate_proj.weight`` is
    ``(n_experts, hidden, d_model)``), as in torchtitan and transformers 5.

    After each forward, ``aux_loss`` holds DeepSeek's expert-level balance loss
    ``N / K * sum_i f_i P_i`` over the batch (``f_i``: share of tokens routed to expert ``i``,
    ``P_i``: its mean score, scores normalised per token; 1 when perfectly balanced). In
    training mode the tokens each expert got are summed until :meth:`after_optimizer_step`
    moves ``expert_bias`` (summed first over the processes holding this block when
    ``torch.distributed`` runs: all of them, or :meth:`use_statistics_group`'s, so every replica
    moves the bias alike).
    """

    statistics_group = None  # the processes whose loads are summed (None: all of them)
    counting = True  # whether a training forward adds to the loads (statistics_paused)

    def __init__(self, config, d_model: int):
        super().__init__()
        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.scoring, self.group_score = config.scoring, config.group_score
        self.n_groups, self.topk_groups = config.n_groups, config.topk_groups
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        self.on_input = config.weight_on == "input"
        self.bias_update_speed = config.bias_update_speed if config.expert_bias else 0.0
        self.router = nn.Linear(d_model, config.n_experts, bias=False)  # not adaptable, as MoE's (route reads it)
        self.experts = GroupedExperts(config.expert, d_model, config.n_experts)
        shared = config.shared(d_model)
        self.shared_experts = registry.module_class(shared)(shared, d_model) if shared is not None else None
        if config.expert_bias:  # fp32 like the router; a buffer: no gradient, saved with the weights
            self.register_buffer("expert_bias", torch.zeros(config.n_experts, dtype=torch.float32))
            self.register_buffer("load", torch.zeros(config.n_experts, dtype=torch.float32), persistent=False)
        else:
            self.expert_bias = self.load = None
        self.aux_loss: torch.Tensor | None = None

    def init_weights(self, std: float) -> None:
        """A fresh bias and load (the linear layers are initialised as every linear layer is)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self.load.zero_()

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scores (tokens, n_experts) fp32, chosen experts (tokens, top_k), their weights)``."""
        logits = F.linear(flat.float(), self.router.weight.float())  # (tokens, n_experts)
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        with torch.no_grad():
            choice = scores if self.expert_bias is None else scores + self.expert_bias
            if self.n_groups > 1:
                grouped = choice.view(-1, self.n_groups, self.n_experts // self.n_groups)  # (tokens, groups, per group)
                if self.group_score == "max":
                    rank = grouped.amax(-1)
                else:
                    rank = grouped.topk(2, dim=-1).values.sum(-1)
                best = rank.topk(self.topk_groups, dim=-1).indices  # (tokens, topk_groups)
                keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)
                choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
            chosen = choice.topk(self.top_k, dim=-1).indices  # (tokens, top_k)
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, chosen, weights * self.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (tokens, d_model)
        scores, chosen, weights = self.route(flat)
        out, counts = dispatch(
            flat, self.experts, self.n_experts, chosen, weights.to(x.dtype), self.on_input, self.expert_group
        )
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        if self.scoring == "sigmoid":
            scores = scores / scores.sum(-1, keepdim=True)
        if self.load is not None and self.training and self.counting:
            self.load += counts.float()  # this rank's tokens: the step sums them over the ranks
        counts, mean_scores, tokens = balance_statistics(counts.float(), scores, self.sequence_group)
        routed_share = counts * (self.n_experts / (tokens * self.top_k))  # N/(K T) * count_i
        self.aux_loss = (routed_share * mean_scores).sum()
        return out.reshape(shape)

    @contextlib.contextmanager
    def statistics_paused(self):
        """Forwards inside add nothing to the loads: one run only for its shapes (a pipeline
        stage's metadata inference, on empty tensors past the first stage) is no batch."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def use_statistics_group(self, group) -> None:
        """Sum the loads over ``group`` only: the processes that hold this block (under pipeline
        parallelism, those of its stage; the others hold other layers)."""
        self.statistics_group = group

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Move ``expert_bias`` by ``bias_update_speed`` towards balance: up for an expert that got
        fewer tokens than the mean since the last step, down for one that got more (V3, 2.1.2)."""
        if self.load is None:
            return
        load = self.load.clone()
        self.load.zero_()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(load, group=self.statistics_group)
        if self.bias_update_speed and load.sum() > 0:
            self.expert_bias += self.bias_update_speed * torch.sign(load.mean() - load)
