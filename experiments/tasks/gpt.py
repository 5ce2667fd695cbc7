"""A character-level GPT in the shape of nanoGPT (Karpathy, karpathy/nanoGPT ``model.py``),
written for this project.

    token embedding (vocab x width, tied to the head) + learned position embedding (context x width)
    dropout
    n_layer blocks, pre-LayerNorm:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
        attn: q, k, v projections (width x width each), causal scaled dot-product attention over
              n_head heads (F.scaled_dot_product_attention), output projection, dropout
        mlp:  width -> 4 width, GELU (exact), 4 width -> width, dropout
    ln_f, logits = x @ wte^T (the head is the token embedding, as in nanoGPT)

As nanoGPT: LayerNorm without bias and Linear layers without bias unless ``bias`` (nanoGPT's
``bias=False``), weights drawn from N(0, 0.02^2), the residual output projections (``c_proj``)
from N(0, (0.02 / sqrt(2 n_layer))^2), biases zero. One difference: nanoGPT computes q, k and v
with one fused matrix ``c_attn`` (3 width x width); here they are three matrices ``c_q``,
``c_k``, ``c_v`` (as in Scion's and modded-nanogpt's GPTs), so that the spectral LMO sees each
projection. The function is the same: stacking ``c_q``, ``c_k``, ``c_v`` gives ``c_attn``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTShape:
    vocab: int
    block_size: int        # context length (characters)
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = False


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nanoGPT's: torch's has none to switch off before 2.1)."""

    def __init__(self, width: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.c_q = nn.Linear(s.n_embd, s.n_embd, bias=s.bias)
        self.c_k = nn.Linear(s.n_embd, s.n_embd, bias=s.bias)
        self.c_v = nn.Linear(s.n_embd, s.n_embd, bias=s.bias)
        self.c_proj = nn.Linear(s.n_embd, s.n_embd, bias=s.bias)
        self.resid_dropout = nn.Dropout(s.dropout)
        self.n_head, self.dropout = s.n_head, s.dropout

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (lin(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for lin in (self.c_q, self.c_k, self.c_v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.c_fc = nn.Linear(s.n_embd, 4 * s.n_embd, bias=s.bias)
        self.c_proj = nn.Linear(4 * s.n_embd, s.n_embd, bias=s.bias)
        self.dropout = nn.Dropout(s.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(s.n_embd, s.bias), CausalSelfAttention(s)
        self.ln_2, self.mlp = LayerNorm(s.n_embd, s.bias), MLP(s)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``forward(idx)``: int64 characters (batch, time) -> logits (batch, time, vocab)."""

    def __init__(self, s: GPTShape):
        super().__init__()
        if s.n_embd % s.n_head:
            raise ValueError(f"n_embd={s.n_embd} is not a multiple of n_head={s.n_head}")
        self.shape = s
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(s.vocab, s.n_embd), wpe=nn.Embedding(s.block_size, s.n_embd),
            drop=nn.Dropout(s.dropout), h=nn.ModuleList(Block(s) for _ in range(s.n_layer)),
            ln_f=LayerNorm(s.n_embd, s.bias)))
        self.lm_head = nn.Linear(s.n_embd, s.vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight        # tied, as in nanoGPT
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * s.n_layer))
            elif p.ndim == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.shape.block_size:
            raise ValueError(f"a sequence of {t} characters, the context is {self.shape.block_size}")
        tr = self.transformer
        x = tr.drop(tr.wte(idx) + tr.wpe(torch.arange(t, device=idx.device)))
        for block in tr.h:
            x = block(x)
        return self.lm_head(tr.ln_f(x))


def n_params(model: nn.Module) -> int:
    """Distinct parameters (the tied embedding and head counted once)."""
    return sum(p.numel() for p in model.parameters())
