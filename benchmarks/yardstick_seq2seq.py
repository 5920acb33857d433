"""The translation yardstick: the Transformer of Vaswani et al. (2017) and its training step in
plain PyTorch (``torch.nn.Transformer``'s layers), as a user would write it, with no code of
this project.

Pre-LN encoder and decoder layers (``norm_first=True``) with ReLU feed-forward blocks, a final
LayerNorm on each stack, one embedding table shared by source, target and output projection,
scaled by sqrt(d_model), sinusoidal positions, dropout; label-smoothed cross-entropy on the
target tokens; Adam with the paper's betas, warmup then inverse-square-root learning rate,
gradient clipping; eager fp32 on a CPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class Seq2Seq(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        d_model: int = 256,
        n_heads: int = 4,
        ffn: int = 512,
        layers: int = 3,
        dropout: float = 0.1,
        max_len: int = 256,
        eps: float = 1e-6,
        pad_id: int = 0,
    ):
        super().__init__()
        self.d_model, self.pad_id = d_model, pad_id
        self.embed = nn.Embedding(vocab_size, d_model)
        position = torch.arange(max_len)[:, None] * torch.exp(
            -math.log(10000.0) * torch.arange(0, d_model, 2) / d_model
        )
        table = torch.zeros(max_len, d_model)
        table[:, 0::2], table[:, 1::2] = position.sin(), position.cos()
        self.register_buffer("positions", table, persistent=False)
        self.dropout = nn.Dropout(dropout)
        enc = nn.TransformerEncoderLayer(d_model, n_heads, ffn, dropout, "relu", eps, batch_first=True, norm_first=True)
        dec = nn.TransformerDecoderLayer(d_model, n_heads, ffn, dropout, "relu", eps, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers, nn.LayerNorm(d_model, eps), enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(dec, layers, nn.LayerNorm(d_model, eps))
        nn.init.normal_(self.embed.weight, 0.0, d_model**-0.5)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * math.sqrt(self.d_model) + self.positions[: ids.shape[1]]  # (batch, seq, d_model)
        return self.dropout(x)

    def forward(self, src: torch.Tensor, src_pad: torch.Tensor, tgt: torch.Tensor, tgt_pad: torch.Tensor):
        """Logits ``(batch, tgt_len, vocab)``; ``*_pad`` are True at padding."""
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        memory = self.encoder(self._embed(src), src_key_padding_mask=src_pad)
        hidden = self.decoder(
            self._embed(tgt),
            memory,
            tgt_mask=causal,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return hidden @ self.embed.weight.T  # the output projection tied to the embedding


def inverse_sqrt(step: int, lr: float, warmup: int) -> float:
    """Linear warmup to ``lr``, then ``lr * sqrt(warmup / step)``."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    return lr * math.sqrt(max(warmup, 1) / max(step, 1))


def train(
    model: Seq2Seq,
    batches: Iterator,
    steps: int,
    lr: float,
    warmup: int,
    betas=(0.9, 0.98),
    eps=1e-9,
    label_smoothing: float = 0.1,
    clip: float = 1.0,
    log_interval: int = 20,
) -> dict:
    """``steps`` optimizer steps on ``batches`` of ``(src, src_mask, tgt_in, tgt_mask, tgt_out)``
    (masks True at real tokens, ``tgt_out`` -100 at padding). Returns the wall seconds and real
    tokens (source + target) of each interval of ``log_interval`` steps and the losses read then."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=betas, eps=eps)
    model.train()
    intervals, logged = [], []
    tokens, start = 0, time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = inverse_sqrt(step, lr, warmup)
        src, src_mask, tgt_in, tgt_mask, tgt_out = next(batches)
        logits = model(src, ~src_mask, tgt_in, ~tgt_mask)
        loss = F.cross_entropy(
            logits.flatten(0, 1), tgt_out.flatten(), ignore_index=-100, label_smoothing=label_smoothing
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        tokens += int(src_mask.sum()) + int(tgt_mask.sum())
        if (step + 1) % log_interval == 0:
            logged.append((step + 1, loss.item()))
            now = time.perf_counter()
            intervals.append((now - start, tokens))
            tokens, start = 0, now
    return {"intervals": intervals, "train": logged}
