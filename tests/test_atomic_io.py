"""formats.atomic_io: temp files get unique names in the target's folder, symlinks planted at a
temp name or at the target are never written through, a failed write leaves nothing behind."""

from __future__ import annotations

import os
import stat
import tempfile
import threading

import pytest

from formats.atomic_io import atomic_write_bytes, atomic_write_json, atomic_write_with


def _temps(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_symlink_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "plan.png"
    target.symlink_to(victim)
    atomic_write_with(target, lambda f: f.write(b"png bytes"))
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and target.read_bytes() == b"png bytes"


def test_symlink_at_the_old_fixed_temp_name_is_left_alone(tmp_path):
    # scheduler/plots.py used to write through `<target stem>.tmp.png`; root then overwrote
    # whatever a symlink planted there pointed to
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "plan.tmp.png").symlink_to(victim)
    atomic_write_with(tmp_path / "plan.png", lambda f: f.write(b"png"))
    assert victim.read_text() == "precious" and (tmp_path / "plan.png").read_bytes() == b"png"


def test_a_planted_symlink_at_the_drawn_temp_name_is_skipped(tmp_path, monkeypatch):
    # draw the same two names over and over: the first is a planted symlink, so mkstemp's
    # O_CREAT | O_EXCL must refuse it and take the next one
    names = iter(["planted", "fresh"] * 50)

    class Names:
        def __iter__(self):
            return self

        def __next__(self):
            return next(names)

    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: Names())
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / ".out.json.planted.tmp").symlink_to(victim)
    atomic_write_json(tmp_path / "out.json", {"a": 1})
    assert victim.read_text() == "precious"
    assert (tmp_path / "out.json").read_text() == '{\n "a": 1\n}\n'


def test_temp_names_are_unique_under_concurrent_writers(tmp_path):
    target = tmp_path / "same.bin"
    seen: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def writer(k: int) -> None:
        def write(f) -> None:
            barrier.wait(timeout=10)  # all eight temp files exist at once here
            with lock:
                seen.extend(_temps(tmp_path))
            f.write(bytes([k]) * 10_000)
        atomic_write_with(target, write)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert len(set(seen)) == 8, seen  # eight different names, all in the target's folder
    assert all(n.startswith(".same.bin.") for n in seen)
    data = target.read_bytes()
    assert len(data) == 10_000 and len(set(data)) == 1  # one whole version, never a mix
    assert _temps(tmp_path) == []


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "t.json"
    atomic_write_json(target, [1])

    def boom(f) -> None:
        f.write(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write_with(target, boom)
    assert target.read_text() == "[\n 1\n]\n" and _temps(tmp_path) == []


def test_chunks_halfway_hook_and_permissions(tmp_path):
    target = tmp_path / "sub" / "c.bin"
    at_half: list[bytes] = []

    def halfway() -> None:
        (tmp,) = _temps(target.parent)
        at_half.append((target.parent / tmp).read_bytes())

    atomic_write_bytes(target, [b"abc", memoryview(b"defgh"), bytearray(b"ij")], halfway)
    assert target.read_bytes() == b"abcdefghij" and at_half == [b"abcde"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
