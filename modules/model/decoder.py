"""GPT/LLaMA-style decoder built from a preset, split into pipeline stages.

A stage holds the blocks of its layer range, the token embedding when it starts at layer 0 and
the final norm + LM head (+ loss) when it ends at the last layer. Every parameter is initialised
from a seed derived from (seed, its global name), so a stage's weights do not depend on how the
model is split: every replica and any split start from the same numbers as the full model.

With tied embeddings the last stage keeps its own copy of the embedding matrix as the head
(ModelSpec.stage_params counts it); the runtime sums the two copies' gradients every step so
they stay equal, which trains exactly like one shared matrix.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from formats.models import ModelSpec

INIT_STD = 0.02


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (LLaMA)."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.arch == "gpt":
        return nn.LayerNorm(spec.d_model, eps=spec.norm_eps)
    return RMSNorm(spec.d_model, spec.norm_eps)


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, ...]:
    """cos/sin tables (seq_len, head_dim/2) for rotary position embeddings."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (B, H, T, Dh) by position-dependent angles."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    t = x.shape[-2]
    c, s = cos[:t], sin[:t]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return out.flatten(-2)


class Block(nn.Module):
    """One pre-norm transformer block: causal SDPA attention + MLP (GELU or SwiGLU)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d, f, bias = spec.d_model, spec.d_ff, spec.arch == "gpt"
        self.arch, self.n_heads, self.kv_heads = spec.arch, spec.n_heads, spec.kv_heads
        self.kv_dim, self.gelu = spec.kv_dim, "none" if spec.gelu == "exact" else "tanh"
        self.norm1, self.norm2 = _norm(spec), _norm(spec)
        self.qkv = nn.Linear(d, d + 2 * spec.kv_dim, bias=bias)  # q, k, v fused
        self.proj = nn.Linear(d, d, bias=bias)
        if spec.arch == "gpt":
            self.fc = nn.Linear(d, f, bias=True)
        else:
            self.fc = nn.Linear(d, 2 * f, bias=False)  # gate and up projections fused
        self.out = nn.Linear(f, d, bias=bias)
        if spec.arch == "llama":
            cos, sin = rope_tables(spec.seq_len, d // spec.n_heads, spec.rope_theta)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, d) -> (B, T, d)."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split((d, self.kv_dim, self.kv_dim), dim=-1)
        q, k, v = (z.view(b, t, -1, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        if self.arch == "llama":
            q, k = apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
        if self.kv_heads != self.n_heads:  # grouped-query: head h reads kv head h // group
            group = self.n_heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.fc(self.norm2(x))
        if self.arch == "gpt":
            h = F.gelu(h, approximate=self.gelu)
        else:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return x + self.out(h)


class StageModel(nn.Module):
    """Layers [start, end) of a preset; embedding on the first stage, head + loss on the last."""

    def __init__(self, spec: ModelSpec, start: int, end: int, seed: int | None = 0) -> None:
        super().__init__()
        assert 0 <= start < end <= spec.num_layers, (start, end)
        self.spec, self.start, self.end = spec, start, end
        self.is_first, self.is_last = start == 0, end == spec.num_layers
        d = spec.d_model
        if self.is_first:
            self.embed = nn.Embedding(spec.vocab_size, d)
            if spec.arch == "gpt":
                self.pos = nn.Embedding(spec.seq_len, d)
        # global layer index as the key, so names do not depend on the split
        self.blocks = nn.ModuleDict({str(i): Block(spec) for i in range(start, end)})
        if self.is_last:
            self.norm_f = _norm(spec)
            self.head = nn.Linear(d, spec.vocab_size, bias=False)
        if seed is not None:  # None: leave torch's init (e.g. on the meta device, for sizes)
            self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """Initialise every parameter from a generator seeded by (seed, its name)."""
        depth_scale = 1.0 / math.sqrt(2 * self.spec.num_layers)
        for name, p in self.named_parameters():
            key = "embed.weight" if (name == "head.weight" and self.spec.tie_embeddings) else name
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{key}".encode()))
            with torch.no_grad():
                if p.dim() == 1:  # biases 0, norm scales 1
                    p.fill_(1.0 if "norm" in name else 0.0)
                else:
                    std = INIT_STD * (depth_scale if name.endswith(("proj.weight", "out.weight"))
                                      else 1.0)
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def tied_pair(self) -> list[nn.Parameter]:
        """The tied embedding copies this stage holds (embed.weight and/or head.weight)."""
        if not self.spec.tie_embeddings:
            return []
        out = []
        if self.is_first:
            out.append(self.embed.weight)
        if self.is_last:
            out.append(self.head.weight)
        return out

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """First stage takes tokens (B, T); others hidden states (B, T, d).

        Returns hidden states, or on the last stage the mean cross-entropy against `targets`
        (logits when `targets` is None).
        """
        if self.is_first:
            h = self.embed(x)
            if self.spec.arch == "gpt":
                h = h + self.pos(torch.arange(x.shape[1], device=x.device))
        else:
            h = x
        for block in self.blocks.values():
            h = block(h)
        if not self.is_last:
            return h
        logits = self.head(self.norm_f(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def sync_local_tied_grads(model: StageModel) -> None:
    """On a stage holding both tied copies, give both the summed gradient (like one matrix)."""
    pair = model.tied_pair()
    if len(pair) == 2 and pair[0].grad is not None and pair[1].grad is not None:
        total = pair[0].grad + pair[1].grad
        pair[0].grad.copy_(total)
        pair[1].grad.copy_(total)


def tie_weights_(model: StageModel) -> StageModel:
    """Make a full (single-stage) model share one matrix for embedding and head; for references."""
    assert model.is_first and model.is_last and model.spec.tie_embeddings
    model.head.weight = model.embed.weight
    return model


def count_params(model: nn.Module) -> int:
    """Number of distinct parameter elements."""
    return sum(p.numel() for p in model.parameters())
