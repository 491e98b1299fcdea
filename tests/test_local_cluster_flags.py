"""scripts/local_cluster.py refuses bad flags before it creates anything (no root needed)."""

from __future__ import annotations

import json

import pytest

from formats.errors import run_main
from scripts import local_cluster
from testkit.fuzz import cluster_dict


def _up_refused(tmp_path, monkeypatch, capsys, *flags: str) -> str:
    """Run `up` with `flags`; assert exit 2 and that nothing was created; return stderr."""
    def create(*args: object) -> None:
        raise AssertionError("a namespace was created")

    monkeypatch.setattr("scripts.netemu.netns.create", create)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.json").write_text(json.dumps(cluster_dict()))
    with pytest.raises(SystemExit) as exit_:
        run_main(local_cluster.main, ["up", "--cluster", "c.json", "--hosts", "2",
                                      "--prefix", "fz", *flags])
    assert exit_.value.code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]
    return capsys.readouterr().err


@pytest.mark.parametrize("keys", ["", "missing.pub", "."])
def test_up_sshd_without_a_key_file_exits_2_before_any_namespace(keys, tmp_path, monkeypatch,
                                                                   capsys):
    err = _up_refused(tmp_path, monkeypatch, capsys, "--out-dir", "od", "--sshd", keys)
    assert err.startswith(f"error: --sshd {keys}: ")


@pytest.mark.parametrize("mtu", ["1000", "70000", "x"])
def test_up_with_a_bad_mtu_exits_2_before_any_namespace(mtu, tmp_path, monkeypatch, capsys):
    assert "--mtu" in _up_refused(tmp_path, monkeypatch, capsys, "--mtu", mtu)
