"""The yardstick: a GPT and its training loop in plain PyTorch, written from the definitions
(Radford et al. 2019; Karpathy's nanoGPT), with no code of this project.

The model is nanoGPT's: learned positions, pre-LN blocks of causal self-attention (one fused
``c_attn`` projection, ``scaled_dot_product_attention``) and a GELU MLP of 4 x d_model, a final
LayerNorm, no biases, the output head tied to the token table. Its init: every linear and
embedding weight normal(0, 0.02), the residual projections (``c_proj``) normal(0, 0.02 /
sqrt(2 * n_layer)). The loop is nanoGPT's too: AdamW on two groups (weight decay on every 2-D
tensor, none on the rest; ``foreach`` on CPU as nanoGPT runs it, fused on CUDA), warmup then
cosine learning rate set by hand each step, gradient clipping, eager fp32, and the loss read at
log intervals.

The benchmarks import this file only for the comparison; nothing in the project uses it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (``nn.LayerNorm`` always has one in older torch)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # scaled residual projections (GPT-2)
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        _, t = idx.shape
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        extra = {"fused": True} if device_type == "cuda" else {}
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)


@dataclass
class LoopConfig:
    max_iters: int = 2000
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 2000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_interval: int = 250
    log_interval: int = 10


def get_lr(it: int, c: LoopConfig) -> float:
    """Linear warmup, then cosine down to ``min_lr`` at ``lr_decay_iters``."""
    if it < c.warmup_iters:
        return c.learning_rate * (it + 1) / (c.warmup_iters + 1)
    if it > c.lr_decay_iters:
        return c.min_lr
    ratio = (it - c.warmup_iters) / (c.lr_decay_iters - c.warmup_iters)
    return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c.learning_rate - c.min_lr)


@torch.no_grad()
def estimate_loss(model: GPT, val_batches: Iterable) -> float:
    model.eval()
    losses = [model(x, y)[1].item() for x, y in val_batches]
    model.train()
    return sum(losses) / len(losses)


def train(
    model: GPT,
    batches: Iterator,
    val_batches: Callable[[], Iterable],
    c: LoopConfig,
    device: str = "cpu",
    on_eval: Callable | None = None,
) -> dict:
    """nanoGPT's loop for ``c.max_iters`` steps. ``batches`` yields ``(x, y)`` training batches;
    ``val_batches()`` the validation batches, evaluated every ``c.eval_interval`` steps and at the
    end. Returns the wall seconds of each interval of ``c.log_interval`` steps (evaluation left
    out; the device synchronised at interval ends only), the evaluations as ``(step, val loss,
    training wall seconds so far)`` and the training loss read at each interval's end."""
    optimizer = model.configure_optimizers(c.weight_decay, c.learning_rate, (c.beta1, c.beta2), device)
    model.train()
    intervals, evals, logged = [], [], []
    wall, steps = 0.0, 0
    start = time.perf_counter()
    for it in range(c.max_iters):
        lr = get_lr(it, c)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        _, loss = model(x, y)
        loss.backward()
        if c.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
        if (it + 1) % c.log_interval == 0:
            logged.append((it + 1, loss.item()))  # the one host sync of the interval
            now = time.perf_counter()
            intervals.append((steps, now - start))
            wall += now - start
            start, steps = now, 0
        if (it + 1) % c.eval_interval == 0 or it + 1 == c.max_iters:
            wall += time.perf_counter() - start  # steps since the interval's end (0 when aligned)
            began = time.perf_counter()
            loss_value = estimate_loss(model, val_batches())
            wall += time.perf_counter() - began
            evals.append((it + 1, loss_value, wall))
            if on_eval is not None:
                on_eval(*evals[-1])
            start, steps = time.perf_counter(), 0  # an interval cut by evaluation is not counted
    return {"intervals": intervals, "val": evals, "train": logged}
