"""What the mixture-of-experts blocks (``moe`` and ``deepseek_moe``, :mod:`yamlformer.blocks.ffn`) share: stacked
expert weights, grouped matmuls over them, and the token dispatch to the experts, on one process or
over an expert-parallel group (torch's differentiable all-to-all).

An experts module here is called as ``experts(rows, counts)``: ``rows`` sorted by expert, ``counts``
the rows of each expert it holds (all of them, or under expert parallelism this rank's).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import Shard, distribute_tensor

from yamlformer.blocks.linear import Linear

#: torch's grouped matmul (``F.grouped_mm``, torch 2.8+), where this torch has it
_GROUPED_MM = getattr(F, "grouped_mm", None)
#: dtypes it takes: on CPU (tried on torch 2.13) the float ones; on CUDA bfloat16 (its documented kernels)
_GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}
_ALIGN = 16  # bytes: grouped_mm wants 16-byte aligned data and strides


class _DenseGradient(torch.autograd.Function):
    """The identity, whose backward makes the incoming gradient contiguous: grouped_mm's backward
    refuses a broadcast one (``out.sum()``'s, strides 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


if _GROUPED_MM is not None:
    from torch.utils import flop_counter

    if torch.ops.aten._grouped_mm not in flop_counter.flop_registry:  # FlopCounterMode counts it (torch 2.13 does not)

        @flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)
        def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
            """``2 * output elements * contraction``; both operands 2-D (the weight gradient), the
            output is ``(groups, m, n)`` and the contraction ``a``'s jagged ``k`` in all."""
            if len(a_shape) == 2 and len(b_shape) == 2:
                return 2 * out_shape[1] * out_shape[2] * a_shape[1]
            return 2 * math.prod(out_shape) * a_shape[-1]


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.is_contiguous() and (t.storage_offset() * size) % _ALIGN == 0 and (t.shape[-1] * size) % _ALIGN == 0


def grouped_mm_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes rows ``x`` ``(rows, in)`` and stacked ``weight`` ``(n, out, in)``:
    this torch has it, their device and common dtype are ones it serves (under ``torch.compile``
    bfloat16 only), and both are laid out as it needs (contiguous, 16-byte aligned rows of ``in``
    and of ``out`` elements)."""
    return (
        _GROUPED_MM is not None
        and x.dtype == weight.dtype
        and x.dtype in _GROUPED_DTYPES.get(x.device.type, ())
        # torch 2.13's meta kernel, which torch.compile traces with, takes bfloat16 only
        and (x.dtype == torch.bfloat16 or not torch.compiler.is_compiling())
        and _aligned(x)
        and _aligned(weight)
        and (weight.shape[-2] * weight.element_size()) % _ALIGN == 0
    )


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor, grouped: bool = True
) -> torch.Tensor:
    """Rows ``x`` ``(rows, in)``, sorted by group, each through its group's linear layer: the first
    ``counts[0]`` rows through ``weight[0]`` ``(out, in)`` (and ``bias[0]``), the next ``counts[1]``
    through ``weight[1]``... One ``F.grouped_mm`` where it runs (:func:`grouped_mm_runs`, and
    ``grouped``), else one ``F.linear`` per group, empty groups included: either way every group's
    weight is in the graph, so every expert takes part in every backward (data-parallel ranks then
    reduce the same gradients)."""
    if grouped and grouped_mm_runs(x, weight):
        offsets = counts.cumsum(0).to(torch.int32)  # end of each group's rows
        out = _DenseGradient.apply(_GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets))  # (rows, out)
        if bias is not None:
            out = out + bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
        return out
    parts = x.split(counts.tolist())
    return torch.cat([F.linear(part, weight[e], None if bias is None else bias[e]) for e, part in enumerate(parts)])


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's rows of a tensor split over ranks (a DTensor), differentiably; others as they are."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


class StackedLinear(Linear):
    """``n`` linear layers of one shape as one ``(n, out_features, in_features)`` weight (and
    ``(n, out_features)`` bias): ``forward(rows, counts)`` is :func:`grouped_linear` over the layers
    this rank holds (all, unless expert parallelism split them: a DTensor's local rows). An
    ``nn.Linear``, so ``yamlformer.blocks.init`` initialises it as any linear layer of its name (a ``down_proj``
    as a residual projection); one tensor instead of ``n`` modules builds a 256-expert layer at once
    and shards as one tensor. The seam of ``yamlformer.blocks.linear``, per expert: an adapter's
    factors are stacked too (``lora_A`` ``(n, r, in)``), each expert's rows through its own."""

    def __init__(self, n: int, in_features: int, out_features: int, bias: bool):
        nn.Module.__init__(self)  # nn.Linear's own __init__ would draw a 2-D weight
        self.in_features, self.out_features, self.n = in_features, out_features, n
        bound = in_features**-0.5  # nn.Linear's default draw, until yamlformer.blocks.init runs
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(n, out_features)) if bias else None

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, grouped: bool = True) -> torch.Tensor:
        y = grouped_linear(rows, _local(self.weight), _local(self.bias), counts, grouped)
        return y if self.adapter is None else self.adapter(rows, y, self, counts=counts, grouped=grouped)

    def project(self, x: torch.Tensor, weight: torch.Tensor, counts=None, grouped: bool = True) -> torch.Tensor:
        """Each expert's rows of ``x`` through its own slice of a stacked ``(n, out, in)`` weight."""
        return grouped_linear(x, _local(weight), None, counts, grouped)

    def scale_outputs(self, y: torch.Tensor, scale: torch.Tensor, counts=None, grouped: bool = True) -> torch.Tensor:
        """Each expert's rows of ``y`` times its own row of ``scale`` ``(n, out)``."""
        return y * _local(scale).repeat_interleave(counts, dim=0, output_size=y.shape[0])

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return _local(t)

    def dense_weight(self) -> torch.Tensor:
        return _local(self.weight)

    def extra_repr(self) -> str:
        return (
            f"n={self.n}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


def dispatch(
    flat: torch.Tensor,
    experts,
    n_experts: int,
    top_experts: torch.Tensor,
    gates: torch.Tensor,
    on_input: bool = False,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse dispatch: ``flat`` ``(tokens, d_model)`` through each token's chosen experts
    (``top_experts`` ``(tokens, top_k)``), weighted by ``gates`` ``(tokens, top_k)`` (each expert's
    output, or its input when ``on_input``: Llama 4) and summed. Choices are sorted by expert, so
    each expert multiplies only its own rows (``top_k * tokens`` in all): ``experts(rows, counts)``.

    With ``group`` (expert parallelism) rank ``r`` of its ``E`` holds experts ``[r * n / E,
    (r + 1) * n / E)``: :func:`_exchange` sends each choice to its expert's rank and brings the
    output back. Returns the output ``(tokens, d_model)`` and the tokens each of the ``n_experts``
    got from this process (the balancing statistics of this process's tokens)."""
    top_k = top_experts.shape[-1]
    choice_expert = top_experts.reshape(-1)  # (tokens * top_k,)
    order = torch.argsort(choice_expert, stable=True)
    counts = torch.bincount(choice_expert, minlength=n_experts)
    rows_token = order // top_k  # token of each sorted choice
    rows_gate = gates.reshape(-1)[order, None]  # (tokens * top_k, 1)
    rows = flat[rows_token] * rows_gate if on_input else flat[rows_token]
    out = experts(rows, counts) if group is None else _exchange(rows, counts, experts, group)
    if not on_input:
        out = out * rows_gate
    return torch.zeros_like(flat).index_add(0, rows_token, out), counts


def _exchange(rows: torch.Tensor, counts: torch.Tensor, experts, group) -> torch.Tensor:
    """``experts(rows, counts)`` with the experts split over the ranks of ``group``. Dropless:
    every row is sent, sorted by expert (so by the rank holding it), to that rank by an all-to-all
    whose split sizes are exchanged first (torchtitan's ``ExpertParallel``); the rank regroups what
    it got by expert, runs its experts once over all of it (on no rows too, so every rank's experts
    take part in every backward), and sends the outputs back the same way. Both all-to-alls are
    differentiable (``all_to_all_single_autograd``)."""

    degree = group.size()
    local = counts.numel() // degree
    # (source rank, local expert) -> rows this rank gets from that source for that expert
    got_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, group)).view(degree, local)
    send = counts.view(degree, local).sum(1).tolist()
    receive = got_counts.sum(1).tolist()
    got = funcol.all_to_all_single_autograd(rows, receive, send, group)  # source-major
    # regroup the source-major blocks expert-major: expert j's rows from every source in turn
    block = torch.arange(degree * local, device=rows.device)
    expert_first = (block % local) * degree + block // local  # block (s, j) -> its place j * E + s
    regroup = torch.argsort(torch.repeat_interleave(expert_first, got_counts.reshape(-1)), stable=True)
    out = experts(got[regroup], got_counts.sum(0))
    back = torch.zeros_like(out).index_copy(0, regroup, out)  # source-major again
    return funcol.all_to_all_single_autograd(back, send, receive, group)


class SplitsExperts:
    """A mixture-of-experts block (an ``nn.Module`` with ``n_experts`` and stacked ``experts``)
    that expert parallelism can split: :meth:`use_expert_parallel`, then ``expert_group`` for
    :func:`dispatch`."""

    expert_group = None  # the ranks the routed experts are split over (use_expert_parallel)
    sequence_group = None  # the ranks holding shares of the same sequences (use_context_parallel)

    def use_context_parallel(self, group) -> None:
        """The sequences are split between the ranks of ``group`` (context parallelism): the
        balancing loss counts every share's tokens (:func:`balance_statistics`), as one process
        counts the whole micro-batch's; routing and experts are per token and need nothing."""
        self.sequence_group = group

    def use_expert_parallel(self, mesh) -> list[nn.Module]:
        """Split the routed experts over the ranks of the 1-D device mesh ``mesh`` (expert
        parallelism): each stacked weight becomes a DTensor sharded on dim 0 (rank ``r`` holds
        experts ``[r * n / E, (r + 1) * n / E)``) and tokens travel to their experts' ranks by
        all-to-all (:func:`dispatch` with ``group``). Everything else of the block (the router,
        shared experts, an expert bias) stays whole on every rank and sees this rank's tokens only.
        Returns the split submodule (the stacked experts)."""

        if self.n_experts % mesh.size():
            raise ValueError(f"{self.n_experts} experts do not split over {mesh.size()} expert-parallel ranks")
        for module in self.experts.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                split = distribute_tensor(param.data, mesh, [Shard(0)])
                module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        self.expert_group = mesh.get_group()
        return [self.experts]


def balance_statistics(counts: torch.Tensor, scores: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(tokens routed to each expert, the scores' mean over tokens, tokens)`` of a balancing
    loss: over this rank's tokens, or with ``group`` (the context-parallel ranks,
    which hold shares of the same sequences) over every share of them, so the loss is the whole
    micro-batch's as one process computes it. The counts are summed without gradient, the scores'
    sums through torch's functional all-reduce, whose backward all-reduces too (each rank's scores
    then get the gradient of the one loss)."""
    total, tokens = scores.sum(0), scores.shape[0]
    if group is not None:
        # local: the functional collectives (~0.1 s to import) serve context- and expert-parallel runs only
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_reduce

        counts = counts.clone()
        dist.all_reduce(counts, group=group)
        total = all_reduce(total, "sum", group)  # its backward sums the ranks' gradients
        tokens *= dist.get_world_size(group)
    return counts, total / tokens, tokens
