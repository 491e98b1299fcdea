"""Gather one replica's stages from a run's checkpoints into a `transformers`-loadable folder.

    python scripts/export_hf.py CKPT_DIR --out DIR [--replica R] [--step S] [--max-shard-mb M]

CKPT_DIR is a run's --ckpt-dir (its rank*/ folders; a folder holding it as ckpt/ works too).
A stage held by a shard group (FSDP2) is gathered from all its shards. The newest step whose
checkpoint every stage (and shard) of the replica has completely written is taken
(--step picks another). DIR gets model.safetensors (or model-0000i-of-0000n.safetensors and
model.safetensors.index.json above --max-shard-mb), config.json (LlamaForCausalLM or
GPT2LMHeadModel) and tokenizer.json: the run's tokenizer file, or for the byte tokenizer a
byte-level one (with tokenizer_config.json) that AutoTokenizer loads; all are written into
a temporary folder renamed to DIR at the end, so DIR is complete or absent.
Exit status: 0 written, 2 bad input (`error: ...`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# before anything imports torch: c10d's C++ stack traces stay out of our one-line errors
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

from formats import argtypes  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from formats.hf_config import CONFIG_NAME, hf_config  # noqa: E402
from formats.models import ModelSpec, get_model, spec_from_fields  # noqa: E402

TOKENIZER_NAME = "tokenizer.json"


def build_parser() -> argparse.ArgumentParser:
    """The flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt_dir", metavar="RUN_OR_CHECKPOINT_DIR",
                   help="the run's --ckpt-dir (rank*/ folders), or a folder holding it as ckpt/")
    p.add_argument("--out", required=True, help="folder to create (must not exist or be empty)")
    p.add_argument("--replica", type=argtypes.integer(0, 2 ** 31 - 1), default=0,
                   help="which replica's weights (default 0; DiLoCo replicas differ between "
                        "outer steps)")
    p.add_argument("--step", type=argtypes.integer(0, 10 ** 9), default=None,
                   help="checkpoint step (default: the newest every stage has)")
    p.add_argument("--max-shard-mb", type=argtypes.integer(1, 10 ** 7), default=5000,
                   help="split model.safetensors into shards of at most this many MB "
                        "(default 5000, as transformers does)")
    return p


def find_ckpt_dir(text: str) -> Path:
    """The folder holding rank*/ checkpoint folders."""
    for folder in (Path(text), Path(text) / "ckpt"):
        if folder.is_dir() and any(p.is_dir() and p.name.startswith("rank")
                                   for p in folder.iterdir()):
            return folder
    raise UserError(f"{text}: no rank*/ checkpoint folders in it (or in {text}/ckpt); give "
                    "the run's --ckpt-dir")


def replica_states(ckpt: Path, replica: int, step: int | None) -> tuple[dict, list[dict], int]:
    """(meta of stage 0, each stage's model state in stage order, step) of one replica; a stage
    held by a shard group is gathered from all its D shards."""
    from modules.train.checkpoint import complete_steps, step_path
    from modules.train.export_checks import check_metas

    ranks = sorted(int(p.name[4:]) for p in ckpt.glob("rank*") if p.name[4:].isdigit())
    steps = {r: complete_steps(ckpt, r) for r in ranks}
    metas = {r: _load(step_path(ckpt, r, s[-1]))[0] for r, s in steps.items() if s}
    check_metas(metas, ckpt)  # 'stages' and 'stage' as dist_runner.py writes them
    mine: dict[int, dict[int, int]] = {}  # stage -> shard -> rank
    for r, m in metas.items():
        if m.get("replica") == replica:
            mine.setdefault(m["stage"], {})[m.get("shard", 0)] = r
    if not mine:
        raise UserError(f"--replica {replica}: no complete checkpoint of it in {ckpt}")
    num_stages = len(metas[next(iter(mine[min(mine)].values()))]["stages"])
    missing = sorted(set(range(num_stages)) - set(mine))
    if missing:
        raise UserError(f"{ckpt}: replica {replica} has no checkpoint of stage(s) {missing}")
    for s, shards_of in mine.items():
        degree = metas[shards_of[min(shards_of)]].get("shard_degree", 1)
        lost = sorted(set(range(degree)) - set(shards_of))
        if lost:
            raise UserError(f"{ckpt}: stage {s} of replica {replica} is sharded D = {degree} "
                            f"ways but shard(s) {lost} have no checkpoint; all are needed")
    holders = [[mine[s][i] for i in sorted(mine[s])] for s in range(num_stages)]
    common = set.intersection(*(set(steps[r]) for group in holders for r in group))
    chosen = step if step is not None else max(common, default=None)
    if chosen is None or chosen not in common:
        raise UserError(f"--step {step}: not complete on every stage (and shard) of replica "
                        f"{replica}; complete on all: {sorted(common)}")
    out = [[_load(step_path(ckpt, r, chosen)) for r in group] for group in holders]
    return out[0][0][0], [gather([state["model"] for _, state in group]) for group in out], chosen


def _load(path: Path) -> tuple[dict, dict]:
    from modules.train.checkpoint import load_checkpoint_meta

    return load_checkpoint_meta(path, {}, any_shard_degree=True)


def gather(shards: list[dict]) -> dict:
    """A stage's model state from its shards' (FSDP2 cuts every parameter along dim 0, in
    shard order; one shard: itself)."""
    if len(shards) == 1:
        return shards[0]
    import torch

    return {k: torch.cat([s[k] for s in shards], dim=0) for k in shards[0]}


def spec_of(meta: dict, first_state: dict) -> ModelSpec:
    """The model the checkpoints hold: the plan's config (or preset), vocab from the weights."""
    spec = (spec_from_fields(meta["model_config"], "checkpoint model_config")
            if "model_config" in meta else get_model(meta["model"]))
    return dataclasses.replace(spec, vocab_size=int(first_state["embed.weight"].shape[0]))


def shards(tensors: dict, max_bytes: int) -> list[dict]:
    """Split tensors (in order) into groups of at most max_bytes (a bigger tensor alone)."""
    groups: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += n
    return groups


def write_weights(folder: Path, tensors: dict, max_bytes: int) -> list[str]:
    """model.safetensors, or numbered shards + the index; returns the file names."""
    from safetensors.torch import save_file

    from modules.train.hf_weights import INDEX_NAME, WEIGHTS_NAME

    groups = shards(tensors, max_bytes)
    if len(groups) == 1:
        save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        return [WEIGHTS_NAME]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for name, group in zip(names, groups, strict=True):
        save_file(group, str(folder / name), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total},
             "weight_map": {k: n for n, g in zip(names, groups, strict=True) for k in g}}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return [*names, INDEX_NAME]


def run_tokenizer(ckpt: Path, meta: dict) -> Path | None:
    """The run's tokenizer.json (kept in the checkpoint folder by the runner), checked."""
    want = meta.get("tokenizer", {}).get("sha256", "bytes")
    if want == "bytes":
        return None
    path = ckpt / TOKENIZER_NAME
    if not path.is_file():
        raise UserError(f"{ckpt}: the run used a tokenizer file (sha256 {want[:12]}...) but "
                        f"{TOKENIZER_NAME} is not in the checkpoint folder; copy it there")
    if hashlib.sha256(path.read_bytes()).hexdigest() != want:
        raise UserError(f"{path}: is not the tokenizer the run was trained with (sha256 differs)")
    return path


def main(argv: list[str] | None = None) -> int:
    """Export; prints what was written."""
    args = build_parser().parse_args(argv)
    from modules.train.export_checks import (
        check_destination,
        check_first_stage,
        tensor_bytes,
        write_failed,
    )

    out = Path(args.out)
    check_destination(out)  # before the checkpoints are read: a bad --out fails at once
    ckpt = find_ckpt_dir(args.ckpt_dir)
    meta, states, step = replica_states(ckpt, args.replica, args.step)
    check_first_stage(states[0], ckpt)
    spec = spec_of(meta, states[0])
    from modules.train.hf_weights import to_hf

    tensors = {k: v for state in states for k, v in to_hf(spec, state).items()}
    check_destination(out, tensor_bytes(tensors))  # room for the weights
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        files = write_weights(tmp, tensors, args.max_shard_mb * 10 ** 6)
        (tmp / CONFIG_NAME).write_text(json.dumps(hf_config(spec), indent=2) + "\n")
        tok = run_tokenizer(ckpt, meta)
        if tok is not None:
            shutil.copyfile(tok, tmp / TOKENIZER_NAME)
            tok_files = [TOKENIZER_NAME]
        else:  # the byte tokenizer, as a file AutoTokenizer reads (same ids)
            from modules.data.byte_tokenizer_file import write_byte_tokenizer
            tok_files = write_byte_tokenizer(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # full, read-only, removed meanwhile: one line
            raise write_failed(e, out) from None
        raise
    print(f"exported replica {args.replica} step {step} of {spec.name} ({len(states)} stage(s), "
          f"{sum(t.numel() for t in tensors.values())} parameters) to {out}: "
          f"{', '.join([*files, CONFIG_NAME, *tok_files])}")
    return 0


def entry() -> None:
    """Console entry point (st-export-hf)."""
    run_main(main)


if __name__ == "__main__":
    entry()
