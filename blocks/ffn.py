"""Feed-forward blocks: MLP, gated linear units (SwiGLU, GeGLU), mixture of experts and DeepSeekMoE.

Projection names follow Hugging Face's Llama/Mixtral (``gate_proj``, ``up_proj``,
``down_proj``; the MoE router is ``router``, DeepSeekMoE's always-on experts ``shared_experts``),
so an importer maps weights by name. The MLP has
``up_proj`` and ``down_proj`` only. ``down_proj`` is the residual projection that
``blocks.init`` scales GPT-2 style.
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.nn.functional as F
from torch import nn

from blocks import registry

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


class Linear(nn.Linear):
    """``nn.Linear`` that draws no default values on the meta device, where there are none to
    draw (a meta build of 128 experts x 48 layers otherwise spends seconds in meta ``uniform_``);
    elsewhere nn.Linear's draw, until ``blocks.init`` runs."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


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


class ClampedGLU(GLU):
    """GPT-OSS's clamped SwiGLU: ``gate = min(gate_proj(x), limit)``,
    ``up = clamp(up_proj(x), -limit, limit)``, ``down_proj((up + 1) * gate * sigmoid(alpha * gate))``
    (Hugging Face's ``GptOssExperts._apply_gate``, on separate gate and up projections)."""

    def __init__(self, config, d_model: int, clamp):
        super().__init__(config, d_model)
        self.alpha, self.limit = clamp.alpha, clamp.limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


@contextlib.contextmanager
def _no_collection():
    """Python's cyclic garbage collector paused: it rescans every live module as thousands are
    made (half of a meta build of a 6,144-expert model), and they form no garbage cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class MoE(nn.Module):
    """Top-k mixture of experts (Switch, Mixtral) with sparse dispatch.

    The router (a bias-free linear layer) scores every expert; each token goes to its ``top_k``
    experts with gates softmax-normalised over the chosen logits (equal to Mixtral's softmax
    over all experts, top-k, renormalise). Tokens are sorted by expert and each expert multiplies
    only its own rows, so the expert matmuls cover exactly ``top_k * tokens`` rows.

    After each forward, ``aux_loss`` holds the Switch/Mixtral load-balancing loss
    ``n_experts * sum_e f_e * P_e`` (``f_e``: share of tokens routed to expert ``e``, counting
    every one of a token's ``top_k`` choices; ``P_e``: the mean router probability of ``e``),
    differentiable through ``P_e``. It is computed over every token, padding included.

    GPT-OSS: ``router_bias`` gives the router a bias, ``expert_bias`` the experts' projections
    theirs, and ``clamp`` makes each expert a :class:`ClampedGLU`. The experts are separate
    modules (``experts.{e}.gate_proj``, ``up_proj``, ``down_proj``); Hugging Face's fused,
    interleaved ``gate_up_proj`` is split by the importer.
    """

    def __init__(self, config, d_model: int):
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.router = nn.Linear(d_model, config.n_experts, bias=config.router_bias)
        expert = config.expert  # with expert_bias its bias is on (blocks.configs.ffn)
        if config.clamp is not None:
            make = lambda: ClampedGLU(expert, d_model, config.clamp)
        else:
            make = lambda: registry.module_class(expert)(expert, d_model)
        with _no_collection():  # thousands of modules (128 experts x 48 layers), no cycles among them
            self.experts = nn.ModuleList(make() for _ in range(config.n_experts))
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (tokens, d_model)
        logits = self.router(flat)  # (tokens, n_experts)
        probs = torch.softmax(logits.float(), dim=-1)
        top_probs, top_experts = probs.topk(self.top_k, dim=-1)  # (tokens, top_k)
        gates = (top_probs / top_probs.sum(-1, keepdim=True)).to(x.dtype)
        out, counts = dispatch(flat, lambda e, rows: self.experts[e](rows), self.n_experts, top_experts, gates)

        routed_share = counts.float() / top_experts.numel() * self.top_k  # f_e, summed over k
        self.aux_loss = self.n_experts * (routed_share * probs.mean(0)).sum()
        return out.reshape(shape)


def dispatch(
    flat: torch.Tensor, expert, n_experts: int, top_experts: torch.Tensor, gates: torch.Tensor, on_input: bool = False
):
    """Sparse dispatch: ``flat`` ``(tokens, d_model)`` through each token's chosen experts
    (``top_experts`` ``(tokens, top_k)``; ``expert(e, rows)`` runs expert ``e``), weighted by
    ``gates`` ``(tokens, top_k)`` (each expert's output, or its input when ``on_input``:
    ``expert(e, gate * rows)``, Llama 4) and summed.

    Choices are sorted by expert, so each expert multiplies only its own rows: ``top_k * tokens``
    rows in all. Returns the output ``(tokens, d_model)`` and the tokens each expert got.
    """
    top_k = top_experts.shape[-1]
    choice_expert = top_experts.reshape(-1)  # (tokens * top_k,)
    order = torch.argsort(choice_expert, stable=True)
    counts = torch.bincount(choice_expert, minlength=n_experts)
    rows_token = order // top_k  # token of each sorted choice
    rows_gate = gates.reshape(-1)[order]
    out = torch.zeros_like(flat)
    start = 0
    # Every expert runs, on no rows when no token chose it, so each takes part in every backward:
    # data-parallel ranks then reduce the same gradients (FSDP2 reduces a unit's gradients together).
    for e, n in enumerate(counts.tolist()):
        tokens, gate = rows_token[start : start + n], rows_gate[start : start + n, None]
        y = expert(e, flat[tokens] * gate) if on_input else expert(e, flat[tokens]) * gate
        out.index_add_(0, tokens, y)
        start += n
    return out, counts


def dispatch_parallel(
    flat: torch.Tensor,
    expert,
    n_experts: int,
    top_experts: torch.Tensor,
    gates: torch.Tensor,
    group,
    on_input: bool = False,
):
    """:func:`dispatch` with the experts split over the ranks of ``group`` (expert parallelism):
    rank ``r`` of ``E`` holds experts ``[r * n / E, (r + 1) * n / E)`` and ``expert(j, rows)`` runs
    its ``j``-th. Dropless: every choice is sent, sorted by expert (so by the rank holding it),
    to that rank by an all-to-all whose split sizes are exchanged first (torchtitan's
    ``ExpertParallel``); the rank regroups what it got by expert, runs each local expert once (on
    no rows too, so every rank's experts take part in every backward), sends the outputs back
    the same way, and the gates weight and sum them. Both all-to-alls are differentiable
    (``all_to_all_single_autograd``). Returns the output ``(tokens, d_model)`` and the tokens
    each of the ``n_experts`` got from this rank."""
    from torch.distributed import _functional_collectives as funcol

    degree = group.size()
    local = n_experts // degree
    top_k = top_experts.shape[-1]
    choice_expert = top_experts.reshape(-1)
    order = torch.argsort(choice_expert, stable=True)
    counts = torch.bincount(choice_expert, minlength=n_experts)
    rows_token = order // top_k
    rows_gate = gates.reshape(-1)[order, None]
    rows = flat[rows_token] * rows_gate if on_input else flat[rows_token]
    # (source rank, local expert) -> rows this rank gets from that source for that expert
    got_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, group)).view(degree, local)
    send = counts.view(degree, local).sum(1).tolist()
    receive = got_counts.sum(1).tolist()
    got = funcol.all_to_all_single_autograd(rows, receive, send, group)  # source-major
    # regroup the source-major blocks expert-major: expert j's rows from every source in turn
    block = torch.arange(degree * local, device=flat.device)
    expert_first = (block % local) * degree + block // local  # block (s, j) -> its place j * E + s
    regroup = torch.argsort(torch.repeat_interleave(expert_first, got_counts.reshape(-1)), stable=True)
    grouped = got[regroup]
    outputs, start = [], 0
    for j, n in enumerate(got_counts.sum(0).tolist()):
        outputs.append(expert(j, grouped[start : start + n]))
        start += n
    back = torch.zeros_like(got).index_copy(0, regroup, torch.cat(outputs))  # source-major again
    returned = funcol.all_to_all_single_autograd(back, send, receive, group)
    if not on_input:
        returned = returned * rows_gate
    return torch.zeros_like(flat).index_add(0, rows_token, returned), counts


class StackedLinear(nn.Linear):
    """``n`` linear layers of one shape as one ``(n, out_features, in_features)`` weight (and
    ``(n, out_features)`` bias): ``forward(x, i)`` applies layer ``i``. An ``nn.Linear``, so
    ``blocks.init`` initialises it as any linear layer of its name (a ``down_proj`` as a
    residual projection); one tensor instead of ``n`` modules builds a 256-expert layer at once
    and shards as one tensor."""

    def __init__(self, n: int, in_features: int, out_features: int, bias: bool):
        nn.Module.__init__(self)  # nn.Linear's own __init__ would draw a 2-D weight
        self.in_features, self.out_features, self.n = in_features, out_features, n
        bound = in_features**-0.5  # nn.Linear's default draw, until blocks.init runs
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(n, out_features)) if bias else None

    def forward(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Layer ``i`` of those this rank holds (all, unless expert parallelism split them: a
        DTensor's local rows)."""
        weight, bias = _local(self.weight), _local(self.bias)
        return F.linear(x, weight[i], None if bias is None else bias[i])

    def extra_repr(self) -> str:
        return (
            f"n={self.n}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's rows of a tensor split over ranks (a DTensor), differentiably; others as they are."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class GroupedExperts(nn.Module):
    """``n`` experts of one ``mlp`` or ``glu`` config with stacked weights (``gate_proj``,
    ``up_proj``, ``down_proj``, each a :class:`StackedLinear`); ``forward(x, e)`` is expert
    ``e``, computing exactly what :class:`MLP` or :class:`GLU` computes."""

    def __init__(self, config, d_model: int, n: int):
        super().__init__()
        hidden = config.resolved_hidden_dim(d_model)
        self.gated = config.n_in_projections == 2
        if self.gated:
            self.gate_proj = StackedLinear(n, d_model, hidden, config.bias)
        self.up_proj = StackedLinear(n, d_model, hidden, config.bias)
        self.down_proj = StackedLinear(n, hidden, d_model, config.bias)
        self.act = activation(config.activation)

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x, e)) * self.up_proj(x, e), e)
        return self.down_proj(self.act(self.up_proj(x, e)), e)


class DeepSeekMoE(nn.Module):
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
    moves ``expert_bias`` (summed over all processes first when ``torch.distributed`` runs,
    so every replica moves the bias alike).
    """

    def __init__(self, config, d_model: int):
        super().__init__()
        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.scoring, self.group_score = config.scoring, config.group_score
        self.n_groups, self.topk_groups = config.n_groups, config.topk_groups
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        self.on_input = config.weight_on == "input"
        self.bias_update_speed = config.bias_update_speed if config.expert_bias else 0.0
        self.router = nn.Linear(d_model, config.n_experts, bias=False)
        self.experts = GroupedExperts(config.expert, d_model, config.n_experts)
        shared = config.shared(d_model)
        self.shared_experts = registry.module_class(shared)(shared, d_model) if shared is not None else None
        if config.expert_bias:  # fp32 like the router; a buffer: no gradient, saved with the weights
            self.register_buffer("expert_bias", torch.zeros(config.n_experts, dtype=torch.float32))
            self.register_buffer("load", torch.zeros(config.n_experts, dtype=torch.float32), persistent=False)
        else:
            self.expert_bias = self.load = None
        self.aux_loss: torch.Tensor | None = None
        self.expert_group = None  # the ranks the routed experts are split over (use_expert_parallel)

    def use_expert_parallel(self, mesh) -> list[nn.Module]:
        """Split the routed experts over the ranks of the 1-D device mesh ``mesh`` (expert
        parallelism): each stacked weight becomes a DTensor sharded on dim 0 (rank ``r`` holds
        experts ``[r * n / E, (r + 1) * n / E)``) and tokens travel to their experts' ranks by
        all-to-all (:func:`dispatch_parallel`). The router, the shared experts and the expert bias
        stay whole on every rank (the router and shared experts see this rank's tokens only). Returns
        the split submodule (the stacked experts)."""
        from torch.distributed.tensor import Shard, distribute_tensor

        if self.n_experts % mesh.size():
            raise ValueError(f"{self.n_experts} experts do not split over {mesh.size()} expert-parallel ranks")
        for module in self.experts.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                split = distribute_tensor(param.data, mesh, [Shard(0)])
                module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        self.expert_group = mesh.get_group()
        return [self.experts]

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
        expert = lambda e, rows: self.experts(rows, e)
        if self.expert_group is not None:
            out, counts = dispatch_parallel(
                flat, expert, self.n_experts, chosen, weights.to(x.dtype), self.expert_group, self.on_input
            )
        else:
            out, counts = dispatch(flat, expert, self.n_experts, chosen, weights.to(x.dtype), self.on_input)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        if self.scoring == "sigmoid":
            scores = scores / scores.sum(-1, keepdim=True)
        routed_share = counts.float() * (self.n_experts / chosen.numel())  # N/(K T) * count_i
        self.aux_loss = (routed_share * scores.mean(0)).sum()
        if self.load is not None and self.training:
            self.load += counts.float()
        return out.reshape(shape)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Move ``expert_bias`` by ``bias_update_speed`` towards balance: up for an expert that got
        fewer tokens than the mean since the last step, down for one that got more (V3, 2.1.2)."""
        if self.load is None:
            return
        load = self.load.clone()
        self.load.zero_()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(load)
        if self.bias_update_speed and load.sum() > 0:
            self.expert_bias += self.bias_update_speed * torch.sign(load.mean() - load)
