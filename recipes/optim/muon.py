"""Muon (Jordan et al. 2024) on the hidden matrices, AdamW on the rest: one torch optimizer, one
state (``yamlformer.builder.optim.configs.MuonConfig`` declares the groups).

A Muon step is ``torch.optim.Muon``'s, which it equals on a 2-D tensor (tested): Nesterov
momentum, the update orthogonalised by Keller Jordan's quintic Newton-Schulz iteration, decoupled
weight decay, the shape's learning-rate factor. What ``torch.optim.Muon`` does not take, this does:

* a stack of matrices (routed experts, ``(n_experts, rows, cols)``): each orthogonalised on its own;
* a sharded parameter (FSDP2 and tensor parallelism hold ``DTensor`` shards): the update is
  gathered whole on every rank (``full_tensor``), orthogonalised there, and each rank keeps its
  own shard of the result, as torchtitan's ``DistMuon`` and Moonshot's Muon gather the full
  matrix. Every rank computes the same orthogonalisation from the same gathered update, so a
  sharded run steps exactly as one process does; the price is one all-gather of each hidden
  matrix per step and its Newton-Schulz work repeated on every rank of its shard group.
  Expert-parallel experts are whole on their rank and are orthogonalised there, ungathered.

The AdamW groups step through torch's own AdamW arithmetic (``torch.optim.adam.adam`` with
decoupled decay, multi-tensor), which equals ``torch.optim.AdamW(foreach=True)`` (tested).
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from yamlformer.builder.optim.configs import muon_adjustment
from yamlformer.recipes.optim.implementations import implements

#: Keller Jordan's quintic coefficients (torch.optim.Muon's defaults) and its norm floor
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def ns_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The Newton-Schulz dtype of ``ns_precision``: ``auto`` is bf16 on a GPU (tensor cores, the
    reference's) and fp32 elsewhere (a CPU's bf16 matmuls are emulated: an order of magnitude slower)."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[precision]


def newton_schulz(update: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The update's nearest semi-orthogonal matrix, approximately (``U S' V^T`` with ``S'`` near 1),
    by ``steps`` quintic Newton-Schulz iterations in ``dtype``; a stack of matrices (any leading
    dims) one by one. The 2-D case is ``torch.optim._muon._zeropower_via_newtonschulz`` op for op."""
    a, b, c = NS_COEFFICIENTS
    rows, cols = update.shape[-2:]
    x = update.to(dtype)
    if rows > cols:
        x = x.mT
    if x.ndim == 2:
        x = x / x.norm().clamp(min=EPS)  # spectral norm at most 1
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        lead = x.shape[:-2]
        x = x.reshape(-1, *x.shape[-2:])  # (matrices, rows, cols)
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        x = x.reshape(*lead, *x.shape[-2:])
    return x.mT if rows > cols else x


def orthogonalized(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`newton_schulz` of an update, a ``DTensor`` shard through its whole matrix (module doc)."""
    # local: torch.distributed's tensors load only where an update is orthogonalized
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(update, DTensor):
        whole = newton_schulz(update.full_tensor(), steps, dtype)
        # every rank holds the same whole result: each keeps its shard, no data moves
        return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
    return newton_schulz(update, steps, dtype)


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``muon: True``, AdamW on the others (module doc). Every group has
    ``lr`` and ``weight_decay``; the rest are the optimizer's defaults."""

    def __init__(
        self,
        groups: list[dict],
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_precision: str = "auto",
        adjust_lr: str = "original",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ):
        defaults = {
            "lr": 0.02,
            "weight_decay": 0.0,
            "muon": False,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "ns_precision": ns_precision,
            "adjust_lr": adjust_lr,
            "betas": betas,
            "eps": eps,
        }
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon if group["muon"] else self._adamw)(group)
        return loss

    def _muon(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            dtype = ns_dtype(group["ns_precision"], p.device)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buffer = state["momentum_buffer"]
            buffer.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            update = orthogonalized(update, group["ns_steps"], dtype)
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-lr * muon_adjustment(tuple(p.shape), group["adjust_lr"]))

    def _adamw(self, group: dict) -> None:
        params, grads, averages, squares, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            averages.append(state["exp_avg"])
            squares.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            averages,
            squares,
            [],
            steps,
            foreach=True,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


#: the ``muon`` section's fields that are the optimizer's own settings (the rest make its groups)
SETTINGS = ("momentum", "nesterov", "ns_steps", "ns_precision", "adjust_lr", "betas", "eps")


@implements("muon")
def muon(config, groups: list[dict]) -> Muon:
    """The :class:`Muon` of a ``muon`` recipe section."""
    return Muon(groups, **{name: getattr(config, name) for name in SETTINGS})
