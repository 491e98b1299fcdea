"""scripts/export_hf.py checks its destination and the checkpoints before writing: one line
for each problem (exit 2 through run_main), nothing left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_checkpoint_faults import tmpfs

from formats.errors import UserError
from formats.models import get_model
from modules.model.decoder import StageModel
from modules.train.checkpoint import save_checkpoint, step_path
from scripts import export_hf

META = {"model": "gpt-tiny", "stages": [[0, 4]], "rank": 0, "replica": 0, "stage": 0}


def checkpoint(folder: Path, meta: dict | None = None, model: dict | None = None) -> Path:
    """A one-stage gpt-tiny checkpoint of step 1 in `folder`, its meta or model changed."""
    state = StageModel(get_model("gpt-tiny"), 0, 4, seed=0).state_dict()
    save_checkpoint(step_path(folder, 0, 1), META if meta is None else meta,
                    {"model": state if model is None else model(state)})
    return folder


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_a_sound_checkpoint_exports(tmp_path: Path) -> None:
    ck = checkpoint(tmp_path / "ck")
    assert export_hf.main([str(ck), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize("meta, model, message", [
    ({k: v for k, v in META.items() if k != "stages"}, None, "no valid 'stages'"),
    ({k: v for k, v in META.items() if k != "stage"}, None, "no valid 'stage'"),
    ({**META, "stage": 3}, None, "no valid 'stage' \\(got 3 for 1 stages\\)"),
    (None, lambda s: {k: v for k, v in s.items() if k != "embed.weight"}, "no embed.weight"),
    (None, lambda s: {**s, "embed.weight": s["embed.weight"][0]},
     r"embed.weight has shape \[128\], not \[vocab, d_model\]"),
])
def test_a_damaged_checkpoint_is_named(tmp_path: Path, meta, model, message: str) -> None:
    ck = checkpoint(tmp_path / "ck", meta, model)
    with pytest.raises(UserError, match=message):
        export_hf.main([str(ck), "--out", str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_bad_destinations_are_named_and_nothing_is_left(tmp_path: Path) -> None:
    ck = checkpoint(tmp_path / "ck")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    cases = [(tmp_path / "dangling", "is a symlink to .*nowhere, which does not exist"),
             (Path("/proc/self/hf-export"), "--out /proc/self/hf-export: ")]
    for out, message in cases:
        with pytest.raises(UserError, match=message):
            export_hf.main([str(ck), "--out", str(out)])
    with tmpfs(tmp_path / "ro", "1m", readonly=True) as ro, \
            pytest.raises(UserError, match="--out .*ro/hf: (cannot write in|.*Read-only)"):
        export_hf.main([str(ck), "--out", str(ro / "hf")])
    with tmpfs(tmp_path / "small", "2m") as small:  # gpt-tiny's weights are 3.3 MB
        with pytest.raises(UserError, match="the export needs [0-9]+ bytes, .* free"):
            export_hf.main([str(ck), "--out", str(small / "hf")])
        assert os.listdir(small) == []
    assert not (tmp_path / "nowhere").exists() and leftovers(tmp_path) == []
