"""Model presets (GPT/LLaMA-style decoders) and the sizes the cost model derives from them.

Counting conventions (used by the cost model, the simulator and the runtime alike):
- a "layer" is one transformer block; the token embedding sits before layer 0 (first stage),
  the final norm and LM head after the last layer (last stage);
- FLOPs are for one token: forward = 2 x (matmul parameters) + 4 x seq_len x d_model for the
  attention scores and weighted sum (dense, not halved for the causal mask); backward = 2 x forward.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass

from formats.errors import UserError
from formats.model_size import check_model_size


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer."""

    name: str
    arch: str
    """`gpt` (LayerNorm, GELU MLP, learned positions, biases) or `llama` (RMSNorm, SwiGLU, RoPE)."""
    num_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    """Hidden size of the MLP (4 d for GPT; the SwiGLU width for LLaMA)."""
    seq_len: int
    """Training sequence length in tokens."""
    vocab_size: int
    tie_embeddings: bool = True
    """Whether the LM head reuses the token embedding (GPT-2 style)."""
    n_kv_heads: int = 0
    """LLaMA: key/value heads (grouped-query attention when fewer than n_heads; 0: n_heads)."""
    rope_theta: float = 10000.0
    """LLaMA: base of the rotary position embedding's frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm."""
    gelu: str = "exact"
    """GPT: `exact` (erf) GELU or `tanh` (GPT-2's gelu_new approximation)."""

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_heads unless grouped-query attention)."""
        return self.n_kv_heads or self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.kv_heads * (self.d_model // self.n_heads)

    def fields(self) -> dict:
        """The spec as a JSON object (what a plan and a checkpoint record)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        d, f = self.d_model, self.d_ff
        if self.arch == "gpt":
            attn = 4 * d * d + 4 * d
            mlp = 2 * d * f + f + d
            norms = 4 * d
        else:
            attn = 2 * d * d + 2 * d * self.kv_dim
            mlp = 3 * d * f
            norms = 2 * d
        return attn + mlp + norms

    def embedding_params(self) -> int:
        """Parameters on the first stage: token embedding (+ learned positions for GPT)."""
        pos = self.seq_len * self.d_model if self.arch == "gpt" else 0
        return self.vocab_size * self.d_model + pos

    def head_params(self) -> int:
        """Parameters on the last stage: final norm (+ an untied LM head)."""
        norm = 2 * self.d_model if self.arch == "gpt" else self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return norm + head

    def total_params(self) -> int:
        """All parameters (tied embeddings counted once)."""
        return self.embedding_params() + self.num_layers * self.layer_params() + self.head_params()

    def stage_params(self, start: int, end: int) -> int:
        """Parameters held by a stage with layers [start, end) (embedding/head on the ends).

        With tied embeddings the last stage keeps its own copy of the embedding matrix for the
        head (its gradient is all-reduced with the first stage's in a real run), so it counts.
        """
        n = (end - start) * self.layer_params()
        if start == 0:
            n += self.embedding_params()
        if end == self.num_layers:
            n += self.head_params() + (self.vocab_size * self.d_model if self.tie_embeddings else 0)
        return n

    def shard_limit(self) -> int:
        """Most devices a shard group may have: FSDP2 cuts every parameter along dim 0, so D is
        bounded by the smallest dim-0 size of any parameter (norm weights and biases: d_model;
        GPT's learned positions: seq_len; the embedding: vocab), leaving every rank a
        non-empty shard of every parameter."""
        limit = min(self.d_model, self.vocab_size)
        return min(limit, self.seq_len) if self.arch == "gpt" else limit

    def layer_flops_per_token(self) -> float:
        """Forward FLOPs of one block for one token."""
        d, f = self.d_model, self.d_ff
        kv = d if self.arch == "gpt" else self.kv_dim
        matmul = 2 * d * d + 2 * d * kv + (2 if self.arch == "gpt" else 3) * d * f
        return 2.0 * matmul + 4.0 * self.seq_len * d

    def head_flops_per_token(self) -> float:
        """Forward FLOPs of the LM head (logits) for one token."""
        return 2.0 * self.vocab_size * self.d_model

    def stage_flops_per_token(self, start: int, end: int) -> float:
        """Forward FLOPs per token of a stage with layers [start, end)."""
        flops = (end - start) * self.layer_flops_per_token()
        if end == self.num_layers:
            flops += self.head_flops_per_token()
        return flops

    def activation_bytes_per_sequence(self, bytes_per_value: int = 2) -> int:
        """Bytes of the hidden state passed across a stage boundary for one sequence."""
        return self.seq_len * self.d_model * bytes_per_value


PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("gpt-tiny", "gpt", num_layers=4, d_model=128, n_heads=4, d_ff=512,
                  seq_len=64, vocab_size=256),
        ModelSpec("gpt-small", "gpt", num_layers=6, d_model=384, n_heads=6, d_ff=1536,
                  seq_len=128, vocab_size=256),
        ModelSpec("llama-150m", "llama", num_layers=12, d_model=768, n_heads=12, d_ff=2048,
                  seq_len=1024, vocab_size=32000, tie_embeddings=False),
        ModelSpec("gpt3-xl", "gpt", num_layers=24, d_model=2048, n_heads=16, d_ff=8192,
                  seq_len=2048, vocab_size=50257),
        ModelSpec("llama-1b", "llama", num_layers=16, d_model=2048, n_heads=32, d_ff=8192,
                  seq_len=2048, vocab_size=128256),
    )
}


def get_model(name: str) -> ModelSpec:
    """Look up a preset by name; UserError lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(PRESETS)
        raise UserError(f"model: unknown preset {name!r}; known presets: {known}") from None


def model_record(spec: ModelSpec) -> dict | None:
    """What a plan records of its model: None for an unchanged preset, else every field."""
    return None if PRESETS.get(spec.name) == spec else spec.fields()


def spec_from_fields(obj: object, where: str) -> ModelSpec:
    """A ModelSpec from its JSON object (ModelSpec.fields), every field checked by name."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected an object of model fields")
    known = ModelSpec.__dataclass_fields__
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise UserError(f"{where}: unknown fields {unknown}; known: {sorted(known)}")
    kinds = {"name": str, "arch": str, "gelu": str, "tie_embeddings": bool,
             "rope_theta": float, "norm_eps": float}
    for key, value in obj.items():
        want = kinds.get(key, int)
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              if want is float else type(value) is want)
        if not ok:
            raise UserError(f"{where}.{key}: expected {want.__name__}, got {value!r}")
    missing = [k for k, f in known.items() if k not in obj and f.default is MISSING]
    if missing:
        raise UserError(f"{where}: missing fields {missing}")
    spec = ModelSpec(**obj)
    check_spec(spec, where)
    check_model_size(spec, where)
    return spec


def check_spec(spec: ModelSpec, where: str) -> None:
    """UserError naming the first field that cannot describe a model this code builds."""
    if spec.arch not in ("gpt", "llama"):
        raise UserError(f"{where}.arch: must be gpt or llama, got {spec.arch!r}")
    for key in ("num_layers", "d_model", "n_heads", "d_ff", "seq_len", "vocab_size"):
        if not 1 <= getattr(spec, key) <= 10 ** 7:
            raise UserError(f"{where}.{key}: must be between 1 and 10^7, got "
                            f"{getattr(spec, key)}")
    if spec.d_model % spec.n_heads or (spec.d_model // spec.n_heads) % 2:
        raise UserError(f"{where}: d_model {spec.d_model} must split into {spec.n_heads} heads "
                        "of an even width")
    if not 0 <= spec.n_kv_heads <= spec.n_heads or spec.n_heads % spec.kv_heads:
        raise UserError(f"{where}.n_kv_heads: must divide n_heads {spec.n_heads}, got "
                        f"{spec.n_kv_heads}")
    if spec.arch == "gpt" and spec.kv_heads != spec.n_heads:
        raise UserError(f"{where}.n_kv_heads: grouped-query attention is LLaMA-only here")
    if spec.gelu not in ("exact", "tanh"):
        raise UserError(f"{where}.gelu: must be exact or tanh, got {spec.gelu!r}")
    if not (0 < spec.rope_theta < math.inf and 0 < spec.norm_eps < 1):
        raise UserError(f"{where}: rope_theta must be > 0 and norm_eps in (0, 1)")
