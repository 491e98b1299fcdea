"""`cluster_ssh.py collect` against a hostile host (a fake SFTP server): names that would leave
--dest ('..', absolute, with slashes, through a planted symlink) are refused, remote symlinks
are not followed, an endless tree and an oversized file stop at the bounds, and sync writes
each file under a temporary name and renames it (hosts sharing one filesystem)."""

from __future__ import annotations

import io
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip(
    "paramiko", reason="paramiko is not installed (the SSH launchers need it: pip install -e .)")

from scripts.netemu import sshctl  # noqa: E402
from scripts.netemu.hostlist import HostEntry


@dataclass
class Attr:
    """An SFTP stat result."""

    st_mode: int
    st_size: int = 0


class FakeSFTP:
    """A hostile SFTP server: a dict of path -> bytes (file), list of names (folder),
    'LINK' (symlink) or a callable (an endless folder)."""

    def __init__(self, tree: dict) -> None:
        self.tree = tree
        self.renamed: list[tuple[str, str]] = []
        self.put_to: list[str] = []

    def __enter__(self) -> FakeSFTP:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def _node(self, path: str):  # noqa: ANN202
        if path in self.tree:
            return self.tree[path]
        if path.startswith("/deep"):  # every folder holds one more folder
            return ["d"]
        raise FileNotFoundError(path)

    def lstat(self, path: str) -> Attr:
        node = self._node(path)
        if node == "LINK":
            return Attr(stat.S_IFLNK | 0o777)
        if isinstance(node, list):
            return Attr(stat.S_IFDIR | 0o755)
        return Attr(stat.S_IFREG | 0o644, len(node))

    def listdir(self, path: str) -> list[str]:
        return list(self._node(path))

    def open(self, path: str, mode: str) -> io.BytesIO:
        return io.BytesIO(self._node(path))

    # sync's side
    def stat(self, path: str) -> Attr:
        return Attr(stat.S_IFDIR | 0o755)

    def put(self, local: str, remote: str) -> None:
        self.put_to.append(remote)

    def chmod(self, path: str, mode: int) -> None:
        return None

    def posix_rename(self, a: str, b: str) -> None:
        self.renamed.append((a, b))


class FakeClient:
    def __init__(self, sftp: FakeSFTP) -> None:
        self.sftp = sftp

    def open_sftp(self) -> FakeSFTP:
        return self.sftp


HOST = HostEntry("root", "10.0.0.9", 22)


def collect(monkeypatch, tmp_path: Path, tree: dict, remote: str = "/r/logs"):
    """Run sshctl.collect against the fake server; (result, dest)."""
    sftp = FakeSFTP(tree)
    monkeypatch.setattr(sshctl, "for_all",
                        lambda hosts, opt, fn: [fn(0, hosts[0], FakeClient(sftp))])
    dest = tmp_path / "dest"
    dest.mkdir(exist_ok=True)
    return sshctl.collect([HOST], None, remote, dest)[0], dest


def files_outside(tmp_path: Path, dest: Path) -> list[Path]:
    return [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_relative_to(dest)]


@pytest.mark.parametrize("name", ["..", "../../../x", "/etc/evil", "a/../../b", "sub/../..",
                                  "."])
def test_collect_refuses_a_name_that_leaves_dest(monkeypatch, tmp_path, name):
    res, dest = collect(monkeypatch, tmp_path, {"/r/logs": ["ok.log", name],
                                                "/r/logs/ok.log": b"fine",
                                                f"/r/logs/{name}": b"pwned"})
    assert res.status == 1 and "refused" in res.stderr and repr(name) in res.stderr
    assert files_outside(tmp_path, dest) == []
    assert not any(p.read_bytes() == b"pwned" for p in tmp_path.rglob("*") if p.is_file())


def test_collect_does_not_write_through_a_planted_local_symlink(monkeypatch, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    host_dir = dest / "root@10.0.0.9_22" / "logs"
    host_dir.mkdir(parents=True)
    (host_dir / "sub").symlink_to(outside)
    res, _ = collect(monkeypatch, tmp_path, {"/r/logs": ["sub"], "/r/logs/sub": ["x"],
                                             "/r/logs/sub/x": b"pwned"})
    assert res.status == 1 and "symlink" in res.stderr
    assert list(outside.iterdir()) == []


def test_collect_skips_remote_symlinks_and_bounds_an_endless_tree(monkeypatch, tmp_path):
    res, dest = collect(monkeypatch, tmp_path, {"/r/logs": ["a.log", "passwd"],
                                                "/r/logs/a.log": b"log",
                                                "/r/logs/passwd": "LINK"})
    assert res.status == 0 and "1 symlink(s)/special file(s) not copied" in res.stdout
    assert (dest / "root@10.0.0.9_22" / "logs" / "a.log").read_bytes() == b"log"
    assert not (dest / "root@10.0.0.9_22" / "logs" / "passwd").exists()
    res, _ = collect(monkeypatch, tmp_path, {}, remote="/deep")
    assert res.status == 1 and f"deeper than {sshctl.MAX_COLLECT_DEPTH} folders" in res.stderr


def test_collect_bounds_total_bytes_and_leaves_no_partial_file(monkeypatch, tmp_path):
    monkeypatch.setattr(sshctl, "MAX_COLLECT_BYTES", 1000)
    res, dest = collect(monkeypatch, tmp_path, {"/r/logs": ["a", "b"], "/r/logs/a": b"x" * 600,
                                                "/r/logs/b": b"y" * 600})
    assert res.status == 1 and "over the 1000 bytes" in res.stderr
    got = sorted(p.name for p in dest.rglob("*") if p.is_file())
    assert got == ["a"]  # b's temporary file is gone


def test_sync_puts_under_a_temporary_name_and_renames(monkeypatch, tmp_path):
    (tmp_path / "plan.json").write_text("{}")
    sftp = FakeSFTP({})
    monkeypatch.setattr(sshctl, "for_all",
                        lambda hosts, opt, fn: [fn(k, h, FakeClient(sftp))
                                                for k, h in enumerate(hosts)])
    res = sshctl.sync([HOST, HOST], None, [tmp_path / "plan.json"], "/repo")
    assert [r.status for r in res] == [0, 0]
    assert len(set(sftp.put_to)) == 2 and all(t.endswith(".tmp") for t in sftp.put_to)
    assert [b for _, b in sftp.renamed] == ["/repo/plan.json"] * 2
