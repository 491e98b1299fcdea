"""How big a model is, worked out from its spec before anything is allocated, and the refusal
of one that no run here could hold, naming the field that makes it so.

Each dimension of a spec may be up to 10^7 (formats.models.check_spec), so a config.json can
describe 10^21 parameters with numbers that each look reasonable; building it ends in a
MemoryError or an allocator dump. Pure python: the runner's check against this host's memory
(modules.device.memory) uses the same figures.
"""

from __future__ import annotations

from typing import Any

from formats.errors import UserError

ModelSpec = Any
"""A formats.models.ModelSpec (not imported: formats.models checks the size of the specs it
reads with this module, and the layering test counts type-only imports as imports)."""

TRAIN_BYTES_PER_PARAM = 16
"""fp32 weights, gradients and AdamW's two moments: the least a trained parameter costs."""
MAX_PARAMS = 10 ** 13
"""Ten trillion parameters (160 TB of training state): beyond any cluster this code plans."""


def size_terms(spec: ModelSpec, names: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """(parameters, how) of each part of the model, largest first; `names` renames the spec's
    fields in `how` (e.g. to a config.json's keys)."""
    n = names or {}
    f = {k: f"{n.get(k, k)} {getattr(spec, k)}" for k in
         ("num_layers", "d_model", "vocab_size", "seq_len", "d_ff")}
    terms = [(spec.num_layers * spec.layer_params(),
              f"{f['num_layers']} layers of {spec.layer_params():.3g} parameters "
              f"({f['d_model']}, {f['d_ff']})"),
             (spec.vocab_size * spec.d_model * (1 if spec.tie_embeddings else 2),
              f"the embedding{'' if spec.tie_embeddings else ' and head'} "
              f"({f['vocab_size']} x {f['d_model']})")]
    if spec.arch == "gpt":
        terms.append((spec.seq_len * spec.d_model,
                      f"the learned positions ({f['seq_len']} x {f['d_model']})"))
    return sorted(terms, reverse=True)


def gigabytes(n_bytes: float) -> str:
    """`12.3 GB` (or TB/PB for the absurd figures a refusal shows)."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.3g} {unit}"
    return f"{n_bytes / 1e9:.3g} GB"


def check_model_size(spec: ModelSpec, where: str, names: dict[str, str] | None = None) -> None:
    """UserError when the model has more than MAX_PARAMS parameters, naming the part (and so
    the fields) that holds most of them and the training memory it would need."""
    total = spec.total_params()
    if total <= MAX_PARAMS:
        return
    count, how = size_terms(spec, names)[0]
    raise UserError(f"{where}: {total:.3g} parameters ({gigabytes(total * TRAIN_BYTES_PER_PARAM)}"
                    f" of training memory), more than the {MAX_PARAMS:.0e} any run here can "
                    f"hold; most are in {how}: {count:.3g}")
