"""Our stage parameters <-> Hugging Face `transformers` tensors (LlamaForCausalLM, GPT2LMHeadModel).

Names follow each stage's global layer index, so a stage converts alone: scripts/export_hf.py
merges the stages of one replica, and `--init-from` reads only its own stage's tensors. Our
fused projections are cut into Hugging Face's pieces (q/k/v, gate/up); LLaMA's q and k rows are
permuted from our interleaved rotary pairs to Hugging Face's rotate-half layout (the inverse of
transformers' Meta-LLaMA conversion), and GPT-2's Conv1D weights are transposed. Tied
embeddings are written once (the embedding), as transformers ties the head to it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from formats.errors import UserError
from formats.hf_folder import INDEX_NAME, WEIGHTS_NAME, FolderWeights  # noqa: F401 - export_hf
from formats.models import ModelSpec

# our name in a block -> ([(HF name, transform)], sizes along dim 0 of our fused tensor or None)
LLAMA_BLOCK = {
    "norm1.weight": ([("input_layernorm.weight", None)], None),
    "qkv.weight": ([("self_attn.q_proj.weight", "rope_q"), ("self_attn.k_proj.weight", "rope_k"),
                    ("self_attn.v_proj.weight", None)], "qkv"),
    "proj.weight": ([("self_attn.o_proj.weight", None)], None),
    "norm2.weight": ([("post_attention_layernorm.weight", None)], None),
    "fc.weight": ([("mlp.gate_proj.weight", None), ("mlp.up_proj.weight", None)], "ff"),
    "out.weight": ([("mlp.down_proj.weight", None)], None),
}
GPT2_BLOCK = {
    f"{ours}.{kind}": ([(f"{theirs}.{kind}", "T" if kind == "weight" and conv else None)], None)
    for ours, theirs, conv in (("norm1", "ln_1", False), ("qkv", "attn.c_attn", True),
                               ("proj", "attn.c_proj", True), ("norm2", "ln_2", False),
                               ("fc", "mlp.c_fc", True), ("out", "mlp.c_proj", True))
    for kind in ("weight", "bias")
}
ENDS = {"llama": {"embed.weight": "model.embed_tokens.weight", "norm_f.weight": "model.norm.weight",
                  "head.weight": "lm_head.weight"},
        "gpt": {"embed.weight": "transformer.wte.weight", "pos.weight": "transformer.wpe.weight",
                "norm_f.weight": "transformer.ln_f.weight", "norm_f.bias": "transformer.ln_f.bias",
                "head.weight": "lm_head.weight"}}


def _rope_perm(w: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    """Rows of each head from interleaved pairs (ours) to halves (Hugging Face), or back."""
    rows, cols = w.shape
    half = rows // heads // 2
    shape = (heads, half, 2, cols) if to_hf else (heads, 2, half, cols)
    return w.reshape(shape).transpose(1, 2).reshape(rows, cols)


def _transform(spec: ModelSpec, how: str | None, w: torch.Tensor, to_hf: bool) -> torch.Tensor:
    if how == "T":
        return w.t()
    if how in ("rope_q", "rope_k"):
        return _rope_perm(w, spec.n_heads if how == "rope_q" else spec.kv_heads, to_hf)
    return w


def _sizes(spec: ModelSpec, kind: str | None) -> list[int] | None:
    if kind == "qkv":
        return [spec.d_model, spec.kv_dim, spec.kv_dim]
    return [spec.d_ff, spec.d_ff] if kind == "ff" else None


def _plan(spec: ModelSpec, name: str) -> tuple[list[tuple[str, str | None]], list[int] | None]:
    """The HF pieces of one of our parameter names (global layer index in the name)."""
    if name.startswith("blocks."):
        _, layer, rest = name.split(".", 2)
        table = LLAMA_BLOCK if spec.arch == "llama" else GPT2_BLOCK
        prefix = f"model.layers.{layer}." if spec.arch == "llama" else f"transformer.h.{layer}."
        pieces, kind = table[rest]
        return [(prefix + hf, how) for hf, how in pieces], _sizes(spec, kind)
    return [(ENDS[spec.arch][name], None)], None


def skipped(spec: ModelSpec, name: str) -> bool:
    """Our head copy of a tied embedding: Hugging Face ties it to the embedding itself."""
    return name == "head.weight" and spec.tie_embeddings


def to_hf(spec: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stage's state dict (ours) -> Hugging Face tensors (contiguous fp32 CPU copies)."""
    out = {}
    for name, tensor in state.items():
        if skipped(spec, name):
            continue
        pieces, sizes = _plan(spec, name)
        parts = tensor.detach().float().cpu().split(sizes) if sizes else [tensor]
        for (hf, how), part in zip(pieces, parts, strict=True):
            out[hf] = _transform(spec, how, part.detach().float().cpu(), True).contiguous()
    return out


def from_hf(spec: ModelSpec, wanted: dict[str, torch.Size],
            get: Callable[[str, torch.Size], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensors for the names and shapes in `wanted`, from `get(hf name, hf shape)`."""
    out = {}
    for name, shape in wanted.items():
        source = "embed.weight" if skipped(spec, name) else name
        pieces, sizes = _plan(spec, source)
        rows = sizes or [shape[0]]
        parts = []
        for (hf, how), n in zip(pieces, rows, strict=True):
            want = (n, *shape[1:])
            hf_shape = torch.Size(want[::-1] if how == "T" else want)
            parts.append(_transform(spec, how, get(hf, hf_shape), False))
        out[name] = torch.cat(parts) if len(parts) > 1 else parts[0]
    return out


def keep_tokenizer(ckpt_dir: str, tokenizer: str) -> None:
    """Copy the run's tokenizer file into its checkpoint folder (for scripts/export_hf.py)."""
    from formats.atomic_io import atomic_write_bytes

    if tokenizer == "bytes" or not Path(tokenizer).is_file():
        return  # a missing file is --tokenizer's error, named when it is loaded
    data = Path(tokenizer).read_bytes()
    dest = Path(ckpt_dir) / "tokenizer.json"
    if not dest.is_file() or dest.read_bytes() != data:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(dest, [data])


class WeightReader:
    """Tensors of a Hugging Face folder, read one at a time (only what a stage needs); every
    file's header is checked against the file first (formats.hf_folder), so the safetensors
    library only ever maps sound files."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.weights = FolderWeights(self.folder, f"--init-from {self.folder}")
        self._open: dict[Path, object] = {}

    def get(self, name: str, shape: torch.Size) -> torch.Tensor:
        """Tensor `name`, checked for shape and a floating dtype (before it is read), as fp32."""
        from safetensors import SafetensorError, safe_open

        path, _ = self.weights.entry(name, tuple(shape))
        try:
            if path not in self._open:
                self._open[path] = safe_open(path, framework="pt")
            tensor = self._open[path].get_tensor(name)  # type: ignore[attr-defined]
        except (OSError, SafetensorError) as e:  # changed since its header was checked
            raise UserError(f"--init-from {self.folder}: cannot read tensor {name} from "
                            f"{path.name} ({e})") from None
        return tensor.float()


def load_stage_weights(model: torch.nn.Module, spec: ModelSpec, folder: str) -> int:
    """Copy a stage's own parameters from a Hugging Face folder; returns how many tensors."""
    wanted = {name: p.shape for name, p in model.state_dict().items()}
    tensors = from_hf(spec, wanted, WeightReader(folder).get)
    model.load_state_dict(tensors, strict=True)
    return len(tensors)


def check_init_from(folder: str, spec: ModelSpec) -> None:
    """UserError when the folder's config.json describes another model than the run's (the
    name and vocabulary aside: the vocabulary follows the tokenizer, checked by shape)."""
    from formats.hf_config import resolve_model

    if not Path(folder).is_dir():
        raise UserError(f"--init-from {folder}: not a folder (expected config.json and "
                        "*.safetensors, as scripts/export_hf.py or transformers write)")
    theirs = resolve_model(str(Path(folder) / "config.json"), "--init-from")
    mine, other = spec.fields(), theirs.fields()
    diff = [k for k in mine if k not in ("name", "vocab_size") and mine[k] != other[k]]
    if diff:
        shown = ", ".join(f"{k} {other[k]!r} (run: {mine[k]!r})" for k in diff)
        raise UserError(f"--init-from {folder}: its config.json differs from the run's model "
                        f"{spec.name}: {shown}")


def init_tokenizer(folder: str | None, tokenizer: str | None) -> str:
    """--tokenizer, else the --init-from folder's tokenizer.json (bytes when it is the byte
    tokenizer's file that export_hf.py writes), else bytes."""
    from modules.data.byte_tokenizer_file import is_byte_tokenizer

    if tokenizer is not None:
        return tokenizer
    path = None if folder is None else Path(folder) / "tokenizer.json"
    if path is not None and path.is_file() and not is_byte_tokenizer(path):
        return str(path)
    return "bytes"
