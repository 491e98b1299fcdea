"""Checkpoint integrity: every corrupted byte is an error naming the file and rank (never a silent
load); 0-byte files and a `meta` that is not a mapping are clear errors; `complete_steps` lists
only intact steps, so `--resume` falls back to the newest step intact on every rank and says
so; `check_finite_state` names a non-finite loss, parameter or gradient."""

from __future__ import annotations

import io
import random

import pytest
import torch

from formats.errors import UserError
from formats.plan import Plan, SyncConfig, save_plan
from modules.train.checkpoint import (
    HEADER,
    check_finite_state,
    complete_steps,
    encode_checkpoint,
    fallback_note,
    load_checkpoint,
    prune,
    save_checkpoint,
    step_files,
    step_path,
    verify_checkpoint,
)
from modules.train.metrics import read_metrics
from tests.conftest import run_entry

META = {"model": "tiny", "rank": 3}


def _trained_state() -> dict:
    """A model and the AdamW state one step leaves (moments, step counts), like a rank's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    return {"step": 1, "model": model.state_dict(), "opt": opt.state_dict()}


def _same(a, b) -> bool:
    """Nested equality of checkpoint states (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _corruptions(good: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    """Every header byte flipped, 1500 random bytes of the payload changed, truncations,
    an appended byte and the empty file."""
    out = []
    positions = list(range(HEADER.size)) + rng.sample(range(HEADER.size, len(good)), 1500)
    for pos in positions:
        data = bytearray(good)
        data[pos] ^= rng.randrange(1, 256)
        out.append((f"byte {pos} changed", bytes(data)))
    for cut in [0, 1, HEADER.size - 1, HEADER.size, len(good) // 2, len(good) - 1]:
        out.append((f"truncated to {cut} bytes", good[:cut]))
    out.append(("one byte appended", good + b"\0"))
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch on the bare, corrupted payloads
def test_every_corrupted_byte_is_an_error_naming_file_and_rank(tmp_path, capsys):
    state = _trained_state()
    path = step_path(tmp_path, 3, 7)
    save_checkpoint(path, META, state)
    good = path.read_bytes()
    assert _same(load_checkpoint(path, META), state) and complete_steps(tmp_path, 3) == [7]
    rng = random.Random(16)
    silent = bare_silent = 0
    trials = _corruptions(good, rng)
    for what, data in trials:
        path.write_bytes(data)
        try:
            load_checkpoint(path, META)
            silent += 1
        except UserError as e:
            assert f"checkpoint {path} is corrupt or unreadable (rank 3: " in str(e), (what, e)
        assert verify_checkpoint(path) is not None, what
        assert complete_steps(tmp_path, 3) == [], what
        if len(data) == len(good) and what.startswith("byte") and int(what.split()[1]) >= 48:
            # the same change in a bare torch.save payload (what ckpt/1 files were): how often
            # does torch itself notice?
            try:
                bare = torch.load(io.BytesIO(data[HEADER.size:]), weights_only=True)
                bare_silent += not _same(bare["state"], state)
            except Exception:
                pass
    log = capsys.readouterr().err
    assert f"error: checkpoint {path} is corrupt or unreadable (rank 3: " in log
    assert "rank 3 skips step 7" in log
    print(f"corruption trials {len(trials)}, silent loads {silent}; the same payload changes "
          f"without the checksum: {bare_silent} loaded silently with different values")
    assert silent == 0
    assert bare_silent > 0, "the trials should include changes torch.load alone misses"


def test_empty_file_and_malformed_contents_are_user_errors(tmp_path):
    path = step_path(tmp_path, 2, 1)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    with pytest.raises(UserError, match=r"rank 2: truncated: 0 bytes"):
        load_checkpoint(path, {})
    for meta, what in (([1, 2], "meta is list"), ("x", "meta is str"), (None, "meta is NoneType")):
        save_checkpoint(path, meta, {"step": 1})  # type: ignore[arg-type]
        with pytest.raises(UserError, match=rf"\(rank 2\): {what}, not a mapping"):
            load_checkpoint(path, {"model": "tiny"})
    save_checkpoint(path, {}, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(UserError, match="state is list, not a mapping"):
        load_checkpoint(path, {})
    # a file from before the checksum (bare torch.save, ckpt/1) cannot be verified
    buf = io.BytesIO()
    torch.save({"format": "ckpt/1", "meta": {}, "state": {}}, buf)
    path.write_bytes(buf.getvalue())
    with pytest.raises(UserError, match="older ckpt/1 file without a checksum"):
        load_checkpoint(path, {})


def test_non_finite_checkpoint_is_refused(tmp_path):
    state = _trained_state()
    state["opt"]["state"][0]["exp_avg"][0, 0] = float("nan")
    path = step_path(tmp_path, 1, 4)
    save_checkpoint(path, {"rank": 1}, state)
    with pytest.raises(UserError, match=r"\(rank 1\): opt\.state\.0\.exp_avg holds non-finite"):
        load_checkpoint(path, {"rank": 1})


def test_complete_steps_skip_corrupt_files_and_prune_keeps_by_name(tmp_path):
    for rank in (0, 1):
        for step in (2, 4, 6):
            save_checkpoint(step_path(tmp_path, rank, step), {"rank": rank}, {"step": step})
    bad = step_path(tmp_path, 1, 6)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, in the middle
    bad.write_bytes(bytes(data))
    lines: list[str] = []
    assert complete_steps(tmp_path, 0, lines.append) == [2, 4, 6]
    assert complete_steps(tmp_path, 1, lines.append) == [2, 4]
    assert lines == [f"error: checkpoint {bad} is corrupt or unreadable (rank 1: sha256 of its "
                     "bytes does not match the one written with it (changed on disk)); rank 1 "
                     "skips step 6, so --resume falls back to an older step if every rank has "
                     "one intact"]
    assert fallback_note(tmp_path, 0, 4).startswith("resuming from step 4, not step 6")
    assert fallback_note(tmp_path, 0, 6) is None
    assert step_files(tmp_path, 1) == [2, 4, 6]
    prune(tmp_path, 1, keep=1)  # by name, without reading every file again
    assert step_files(tmp_path, 1) == [6]


def test_check_finite_state_names_loss_parameter_or_gradient():
    model = torch.nn.Linear(4, 2)
    assert check_finite_state(1.5, model.named_parameters()) is None
    assert check_finite_state(None, model.named_parameters()) is None
    assert check_finite_state(torch.tensor(float("nan")), []) == "the loss is nan"
    assert check_finite_state(float("inf"), []) == "the loss is inf"
    model(torch.ones(1, 4)).sum().backward()
    assert check_finite_state(0.1, model.named_parameters()) is None
    with torch.no_grad():
        model.bias[1] = float("-inf")
    assert check_finite_state(0.1, model.named_parameters()) == (
        "parameter bias has 1 non-finite value(s) of 2")
    with torch.no_grad():
        model.bias[1] = 0.0
    model.weight.grad[0, :3] = float("nan")
    model.bias.grad[0] = float("nan")
    assert check_finite_state(0.1, model.named_parameters()) == (
        "the gradient of weight has 3 non-finite value(s) of 8; 1 more tensor(s) too")
    # huge but finite values whose sum overflows are no false alarm; half precision is summed
    # in fp32
    big = torch.nn.Parameter(torch.full((4,), 3e38))
    half = torch.nn.Parameter(torch.full((100,), 60000.0, dtype=torch.float16))
    assert check_finite_state(None, [("big", big), ("half", half)]) is None
    with torch.no_grad():
        half[7] = float("nan")
    assert check_finite_state(None, [("big", big), ("half", half)]) == (
        "parameter half has 1 non-finite value(s) of 100")


def test_encoded_bytes_are_what_save_writes(tmp_path):
    head, payload = encode_checkpoint({"rank": 0}, {"step": 3})
    save_checkpoint(tmp_path / "c.pt", {"rank": 0}, {"step": 3})
    assert (tmp_path / "c.pt").read_bytes() == bytes(head) + bytes(payload)
    assert len(head) == HEADER.size


PLAN_1X2 = Plan("local", "", "gpt-tiny", [(0, 4)], [[0], [1]], micro_batch_size=1,
                sync=SyncConfig(mode="allreduce"))


@pytest.mark.timeout(200)
def test_resume_falls_back_to_the_newest_step_intact_on_every_rank(tmp_path):
    save_plan(PLAN_1X2, tmp_path / "plan.json")
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"

    def launch(*args: str):
        return run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                         "--threads-per-rank", "1", "--grace-s", "2", "--", "--fake-data",
                         "--timeout-s", "60", "--metrics", str(metrics), "--ckpt-dir", str(ck),
                         "--ckpt-every", "2", "--sync-checkpoints", *args, timeout=150)

    first = launch("--steps", "4")
    assert first.returncode == 0, first.stdout[-3000:]
    want = {r["step"]: r["loss"] for r in read_metrics(metrics)}
    assert complete_steps(ck, 0) == complete_steps(ck, 1) == [2, 4]
    bad = step_path(ck, 1, 4)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x10  # a byte in the middle (tensor data): torch alone loads it
    bad.write_bytes(bytes(data))
    resumed = launch("--steps", "6", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert (f"[rank 1] error: checkpoint {bad} is corrupt or unreadable (rank 1: sha256"
            in resumed.stdout), resumed.stdout[-3000:]
    assert "resumed from step 2" in resumed.stdout
    got = {r["step"]: r["loss"] for r in read_metrics(metrics)}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]  # bit-identical replay
    assert "Traceback" not in resumed.stdout
