"""A small GPT whose attention is a parameter: train it with torch's attention and with yours, from one seed.

06 trains the miniature (CPU_CONFIG) in the notebook with the learner's flash_attention_train; the course's
measurement on a GPU (GPU_CONFIG, bf16) is `python -m instructor.gpt`. The model reads bytes (a vocabulary of
256) of flashcourse's own source files, read through importlib.resources, so it trains the same on an installed
package, in Colab or in the repository. `train` with the same seed gives the same initial weights and the same
batches whatever the attention: any difference between two curves comes from the attention alone.
References: nanoGPT (a pre-norm decoder, tied embeddings); grouped-query attention (Ainslie et al., 2023).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 6
    width: int = 384              # d_model
    q_heads: int = 6
    kv_heads: int = 2             # grouped-query attention: 3 query heads per KV head
    context: int = 512            # T
    vocab: int = 256              # bytes


GPU_CONFIG = GPTConfig()
CPU_CONFIG = GPTConfig(layers=1, width=32, q_heads=2, kv_heads=1, context=32)


def sdpa_attention(q, k, v):
    """torch's causal attention: q [B, Hq, T, D], k and v [B, Hkv, T, D] -> [B, Hq, T, D]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])



class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, attention):
        super().__init__()
        self.q_heads, self.kv_heads = config.q_heads, config.kv_heads
        self.head_dim = config.width // config.q_heads
        self.qkv = nn.Linear(config.width, (config.q_heads + 2 * config.kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(config.width, config.width, bias=False)
        self.attention = attention

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split([self.q_heads * self.head_dim, self.kv_heads * self.head_dim,
                                     self.kv_heads * self.head_dim], dim=-1)
        q = q.view(B, T, self.q_heads, self.head_dim).transpose(1, 2)     # [B, Hq, T, D]
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)    # [B, Hkv, T, D]
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)    # [B, Hkv, T, D]
        y = self.attention(q, k, v)                                         # [B, Hq, T, D]
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, attention):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(config.width), nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config, attention)
        self.mlp = nn.Sequential(nn.Linear(config.width, 4 * config.width), nn.GELU(),
                                 nn.Linear(4 * config.width, config.width))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token and position embeddings, `layers` pre-norm blocks, a final norm, tied output weights."""

    def __init__(self, config: GPTConfig, attention):
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.width)
        self.positions = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        """Mean cross-entropy of predicting targets [B, T] from idx [B, T]."""
        B, T = idx.shape
        x = self.tokens(idx) + self.positions(torch.arange(T, device=idx.device))   # [B, T, C]
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.tokens.weight.T                                # [B, T, vocab]
        return F.cross_entropy(logits.float().reshape(B * T, -1), targets.reshape(B * T))


def corpus() -> torch.Tensor:
    """The bytes of flashcourse's own .py files, in a fixed order, as a uint8 tensor."""
    def files(folder):
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if entry.is_dir():
                yield from files(entry)
            elif entry.name.endswith(".py"):
                yield entry
    text = b"".join(f.read_bytes() for f in files(resources.files("flashcourse")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def train(attention, steps: int, config: GPTConfig, batch: int, lr: float = 2e-3, seed: int = 0,
          device: str = "cpu") -> list[float]:
    """Train a GPT with `attention` for `steps` AdamW steps; the training loss at every step.

    The same seed gives the same initial weights and the same batches, whatever the attention.
    """
    data = corpus().to(device)
    torch.manual_seed(seed)
    model = GPT(config, attention).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    losses = []
    for step in range(steps):
        starts = torch.randint(len(data) - config.context - 1, (batch,), generator=gen)
        window = torch.stack([data[i:i + config.context + 1] for i in starts.tolist()]).long()  # [B, T + 1]
        for group in optimizer.param_groups:   # warm up over the first tenth, then cosine decay
            warm = min(1.0, (step + 1) / max(1, steps // 10))
            group["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        with autocast:
            loss = model(window[:, :-1], window[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses
