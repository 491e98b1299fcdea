"""cluster_ssh.py against real OpenSSH servers on loopback addresses (root, openssh-server)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

paramiko = pytest.importorskip(
    "paramiko", reason="paramiko is not installed (the SSH launchers need it: pip install -e .)")

from conftest import ROOT, run_entry  # noqa: E402
from test_ssh_helpers import free_port, keygen, sshd_missing, start_sshd  # noqa: E402

pytestmark = pytest.mark.ssh

_REASON = sshd_missing()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

ADDRS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Three sshd on 127.0.0.2-4 plus a dead entry; a client key; an ip_list."""
    d = tmp_path_factory.mktemp("fleet")
    client_key = keygen(d / "client_key")
    auth = d / "authorized_keys"
    auth.write_text((d / "client_key.pub").read_text())
    servers = []
    try:
        for a in ADDRS:
            servers.append(start_sshd(d, a, auth))
        dead_port = free_port("127.0.0.5")  # nothing listens there
        lines = ["# test fleet"] + [f"root@{s.addr}:{s.port}" for s in servers]
        (d / "ip_list").write_text("\n".join(lines) + "\n")
        (d / "ip_list_dead").write_text("\n".join(lines + [f"root@127.0.0.5:{dead_port}"]) +
                                        "\n")
        yield {"dir": d, "key": str(client_key), "servers": servers,
               "known": str(d / "known_hosts")}
    finally:
        for s in servers:
            s.stop()


def ssh(f, *args: str, hosts: str = "ip_list", known: str | None = None, timeout: float = 60):
    """Run cluster_ssh.py with the fleet's key and known_hosts."""
    return run_entry("scripts/cluster_ssh.py", "--hosts", str(f["dir"] / hosts),
                     "--known-hosts", known or f["known"], "--key", f["key"], "--timeout", "15",
                     *args, timeout=timeout)


def _accepted(f):
    r = ssh(f, "accept-keys")
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_unknown_key_refused_then_accept_keys_records_them(fleet, tmp_path) -> None:
    fresh = str(tmp_path / "kh")
    (tmp_path / "kh").write_text("")
    r = ssh(fleet, "run", "--", "true", known=fresh)
    assert r.returncode == 1
    s0 = fleet["servers"][0]
    fp = paramiko.Ed25519Key.from_private_key_file(str(s0.host_key))
    from scripts.netemu.sshctl import fingerprint
    assert f"[{s0.addr}]:{s0.port}: unknown host key ssh-ed25519 {fingerprint(fp)}" in r.stdout
    assert "0/3 hosts ok" in r.stdout
    acc = ssh(fleet, "accept-keys", known=fresh)
    assert acc.returncode == 0, acc.stdout
    assert f"recorded [{s0.addr}]:{s0.port} ssh-ed25519 {fingerprint(fp)}" in acc.stdout
    again = ssh(fleet, "run", "--", "true", known=fresh)
    assert again.returncode == 0 and "3/3 hosts ok" in again.stdout, again.stdout


@pytest.mark.timeout(60)
def test_parallel_run_exit_status_and_dead_host(fleet) -> None:
    _accepted(fleet)
    # Concurrency, not wall time (the machine may be busy): every host starts its command
    # before the first one finishes its 2 s sleep.
    r = ssh(fleet, "run", "--", 'echo "start $(date +%s.%N)"; sleep 2; '
                               'echo "end $(date +%s.%N)"; echo "hi from $SCATTERED_HOST_INDEX"; '
                               'echo warn >&2; exit $SCATTERED_HOST_INDEX')
    starts = [float(w.split()[-1]) for w in r.stdout.splitlines() if "] start " in w]
    ends = [float(w.split()[-1]) for w in r.stdout.splitlines() if "] end " in w]
    assert len(starts) == len(ends) == 3, r.stdout
    assert max(starts) < min(ends), f"not parallel: starts {starts}, ends {ends}"
    labels = [f"root@{s.addr}:{s.port}" for s in fleet["servers"]]
    assert f"[{labels[1]}] hi from 1" in r.stdout and f"[{labels[2]}]! warn" in r.stdout
    assert f"[{labels[0]}] ok: exit 0" in r.stdout
    assert f"[{labels[2]}] FAILED: exit 2" in r.stdout and r.returncode == 1
    d = ssh(fleet, "run", "--", "echo alive", hosts="ip_list_dead")
    assert d.returncode == 1
    assert "3/4 hosts ok" in d.stdout and "[root@127.0.0.5:" in d.stdout
    assert "FAILED: unreachable" in d.stdout
    assert d.stdout.count("] alive") == 3


def test_sync_and_collect(fleet, tmp_path) -> None:
    _accepted(fleet)
    src = tmp_path / "payload"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "run.sh").write_text("#!/bin/sh\necho ran $1\n")
    (src / "sub" / "run.sh").chmod(0o755)
    remote = tmp_path / "remote"
    # --parallel 1: the three test "hosts" share one filesystem, and concurrent sftp uploads
    # of the same file make paramiko's size check after `put` fail (real hosts do not share).
    r = ssh(fleet, "--parallel", "1", "sync", str(src), "--dest", str(remote))
    assert r.returncode == 0, r.stdout
    assert (remote / "payload" / "a.txt").read_text() == "alpha"
    assert os.access(remote / "payload" / "sub" / "run.sh", os.X_OK)
    logs = tmp_path / "logs"
    idx = "$SCATTERED_HOST_INDEX"
    mk = ssh(fleet, "run", "--", f"mkdir -p {logs} && "
             f"{remote}/payload/sub/run.sh {idx} > {logs}/h{idx}.log")
    assert mk.returncode == 0, mk.stdout
    back = tmp_path / "back"
    c = ssh(fleet, "collect", str(logs), "--dest", str(back))
    assert c.returncode == 0, c.stdout
    for s in fleet["servers"]:
        got = back / f"root@{s.addr}_{s.port}" / "logs"
        assert sorted(p.name for p in got.iterdir()) == ["h0.log", "h1.log", "h2.log"]
        assert (got / "h2.log").read_text() == "ran 2\n"
    missing = ssh(fleet, "collect", str(tmp_path / "nope"), "--dest", str(back))
    assert missing.returncode == 1 and "no such file on the host" in missing.stdout


@pytest.mark.timeout(60)
def test_start_and_kill_by_pid_files(fleet, tmp_path) -> None:
    _accepted(fleet)
    run_dir = tmp_path / "runs"
    st = ssh(fleet, "start", "--name", "sleeper", "--run-dir", str(run_dir), "--",
             "sleep 300; echo never")
    pid_files = [run_dir / f"sleeper@{s.addr}_{s.port}.pid" for s in fleet["servers"]]
    pids = [int(p.read_text()) for p in pid_files if p.exists()]
    try:
        assert st.returncode == 0, st.stdout
        assert len(pids) == 3 and all(os.path.exists(f"/proc/{p}") for p in pids)
        dup = ssh(fleet, "start", "--name", "sleeper", "--run-dir", str(run_dir), "--",
                  "sleep 1")
        assert dup.returncode == 1 and dup.stdout.count("already running") == 3
        k = ssh(fleet, "kill", "--name", "sleeper", "--run-dir", str(run_dir))
        assert k.returncode == 0, k.stdout
        assert all(f"killed {p}" in k.stdout for p in pids), k.stdout
        deadline = time.monotonic() + 10
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)  # the signalled process groups exit asynchronously
        assert not any(_running(p) for p in pids)
        assert not any(p.exists() for p in pid_files)
        again = ssh(fleet, "kill", "--run-dir", str(run_dir))
        assert again.returncode == 0 and "killed" not in again.stdout
    finally:
        for p in pids:
            if _running(p):
                os.killpg(p, 9)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return ") Z " not in stat


def test_changed_host_key_refused(fleet, tmp_path) -> None:
    _accepted(fleet)
    s1 = fleet["servers"][1]
    other = keygen(tmp_path / "impostor")
    imp = paramiko.Ed25519Key.from_private_key_file(str(other))
    known = paramiko.HostKeys(fleet["known"])
    name = f"[{s1.addr}]:{s1.port}"
    known.add(name, "ssh-ed25519", imp)
    bad_known = tmp_path / "known_bad"
    known.save(str(bad_known))
    r = ssh(fleet, "run", "--", "echo reached", known=str(bad_known))
    from scripts.netemu.sshctl import fingerprint
    assert r.returncode == 1 and "2/3 hosts ok" in r.stdout
    assert f"{name}: host key CHANGED" in r.stdout and fingerprint(imp) in r.stdout
    assert r.stdout.count("] reached") == 2
    acc = ssh(fleet, "accept-keys", known=str(bad_known))
    assert acc.returncode == 1 and "REFUSED" in acc.stdout and "--replace" in acc.stdout
    rep = ssh(fleet, "accept-keys", "--replace", known=str(bad_known))
    assert rep.returncode == 0 and f"replaced {name}" in rep.stdout


def test_bad_host_list_is_user_error(tmp_path) -> None:
    f = tmp_path / "ip_list"
    f.write_text("root@127.0.0.2\njusthost\n")
    r = run_entry("scripts/cluster_ssh.py", "--hosts", str(f), "run", "--", "true")
    assert r.returncode == 2 and r.stderr.startswith(f"error: {f}:2:")
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(90)
def test_aws_wrappers_run_batch_kill_copy_logs(fleet, tmp_path) -> None:
    """aws_run_batch.sh starts each host's ranks (modulo mapping); kill; copy logs."""
    _accepted(fleet)
    repo = tmp_path / "repo"
    repo.mkdir()
    # a stand-in dist_runner.py: records its arguments, then waits to be killed
    (repo / "dist_runner.py").write_text(
        "import sys, time\nprint(' '.join(sys.argv[1:]), flush=True)\ntime.sleep(300)\n")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "plan/1", "pipelines": [[0, 1], [2, 3], [4, 5]]}))
    env = dict(os.environ, IP_LIST=str(fleet["dir"] / "ip_list"), KNOWN_HOSTS=fleet["known"],
               SSH_KEY=fleet["key"], REMOTE_REPO=str(repo), REMOTE_PY=sys.executable)
    sh = ROOT / "scripts"
    r = subprocess.run(["bash", str(sh / "aws_run_batch.sh"), str(plan), "tcp://127.0.0.2:29500",
                        "--steps", "3"], env=env, capture_output=True, text=True, timeout=60)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert (repo / "plan.json").exists()
        secret = repo / ".scattered" / "run_secret"  # the run secret: a private file, not argv
        assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_text()) >= 16
        assert not list(repo.rglob("*.tmp")), "a sync left a temporary file"
        logs = [repo / "logs" / f"rank{k}.log" for k in range(6)]
        deadline = time.monotonic() + 20
        while not all(p.exists() and p.read_text() for p in logs) and \
                time.monotonic() < deadline:
            time.sleep(0.1)  # ranks start asynchronously on the hosts
        assert (repo / "logs" / "rank4.log").read_text().split() == [
            "--plan", "plan.json", "--rank", "4", "--world-size", "6", "--dist-url",
            "tcp://127.0.0.2:29500", "--steps", "3"]
    finally:
        k = subprocess.run(["bash", str(sh / "aws_kill.sh")], env=env, capture_output=True,
                           text=True, timeout=60)
    assert k.returncode == 0 and k.stdout.count("killed") == 3, k.stdout
    dest = tmp_path / "collected"
    c = subprocess.run(["bash", str(sh / "aws_copy_logs.sh"), str(dest)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert c.returncode == 0, c.stdout + c.stderr
    s1 = fleet["servers"][1]
    assert (dest / f"root@{s1.addr}_{s1.port}" / "logs" / "rank1.log").exists()


@pytest.mark.timeout(90)
def test_aws_run_batch_stops_when_the_hosts_lack_the_project_python(fleet, tmp_path) -> None:
    """REMOTE_PY without torch on the hosts: a clear error (exit 2), nothing started."""
    _accepted(fleet)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "dist_runner.py").write_text("raise SystemExit('must not start')\n")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "plan/1", "pipelines": [[0, 1], [2, 3], [4, 5]]}))
    env = dict(os.environ, IP_LIST=str(fleet["dir"] / "ip_list"), KNOWN_HOSTS=fleet["known"],
               SSH_KEY=fleet["key"], REMOTE_REPO=str(repo), REMOTE_PY=f"{sys.executable} -S")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "aws_run_batch.sh"), str(plan),
                        "tcp://127.0.0.2:29500"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "No module named 'torch'" in r.stdout, r.stdout
    assert r.stderr.startswith(f"error: REMOTE_PY={sys.executable} -S in REMOTE_REPO={repo} "
                               "cannot run dist_runner.py"), r.stderr
    assert not (repo / "plan.json").exists() and not (repo / "logs").exists()


def test_other_key_type_counts_as_changed_key(fleet, tmp_path) -> None:
    """known_hosts holds ed25519 for a host that now offers only RSA: refused everywhere."""
    rsa = start_sshd(tmp_path, "127.0.0.6", fleet["dir"] / "authorized_keys", key_type="rsa")
    try:
        name = f"[127.0.0.6]:{rsa.port}"
        (tmp_path / "ip1").write_text(f"root@127.0.0.6:{rsa.port}\n")
        known = paramiko.HostKeys()
        known.add(name, "ssh-ed25519",
                  paramiko.Ed25519Key.from_private_key_file(str(keygen(tmp_path / "old"))))
        known.save(str(tmp_path / "kh"))

        def cs(*args: str):  # type: ignore[no-untyped-def]
            return run_entry("scripts/cluster_ssh.py", "--hosts", str(tmp_path / "ip1"),
                             "--known-hosts", str(tmp_path / "kh"), "--key", fleet["key"],
                             *args, timeout=60)
        r = cs("run", "--", "echo reached")
        assert r.returncode == 1 and f"{name}: host key CHANGED: server offers ssh-rsa" in r.stdout
        assert "reached" not in r.stdout.replace("echo reached", "")
        acc = cs("accept-keys")
        assert acc.returncode == 1 and "REFUSED" in acc.stdout and "ssh-rsa" in acc.stdout
        rep = cs("accept-keys", "--replace")
        assert rep.returncode == 0 and f"replaced {name} ssh-rsa" in rep.stdout, rep.stdout
        assert list(paramiko.HostKeys(str(tmp_path / "kh")).lookup(name)) == ["ssh-rsa"]
        ok = cs("run", "--", "echo reached")
        assert ok.returncode == 0 and "] reached" in ok.stdout, ok.stdout
    finally:
        rsa.stop()


def test_unreachable_host_gives_no_paramiko_traceback(tmp_path) -> None:
    """A port that accepts and closes at once: one FAILED line, no logged traceback."""
    srv = socket.socket()
    srv.bind(("127.0.0.7", 0))
    srv.listen(4)
    port = srv.getsockname()[1]

    def serve() -> None:
        with contextlib.suppress(OSError):
            for _ in range(4):
                srv.accept()[0].close()
    threading.Thread(target=serve, daemon=True).start()
    try:
        (tmp_path / "ip1").write_text(f"root@127.0.0.7:{port}\n")
        (tmp_path / "kh").write_text("")
        r = run_entry("scripts/cluster_ssh.py", "--hosts", str(tmp_path / "ip1"),
                      "--known-hosts", str(tmp_path / "kh"), "run", "--", "true", timeout=60)
    finally:
        srv.close()
    assert r.returncode == 1 and "FAILED: unreachable" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr, r.stderr


def test_start_script_waits_for_ready(tmp_path) -> None:
    """start_script(ready_s): ok after `ready`; exit 4 with the log tail when the run dies
    first; exit 4 and the run stopped when it stays silent."""
    from scripts.netemu.hostlist import HostEntry
    from scripts.netemu.sshctl import kill_script, start_failure, start_script
    h = HostEntry("root", "127.0.0.1")
    cases = [("sleep 0.3; echo ready; sleep 30", 0, "ready"),
             ("echo 'error: no iptables' >&2; exit 2", 4, "it exited: error: no iptables"),
             ("sleep 30", 4, "no ready line within 1 s (stopped it)")]
    for cmd, want_rc, want in cases:
        p = subprocess.run(["sh", "-c", start_script(0, h, cmd, "w", str(tmp_path), ready_s=1)],
                           capture_output=True, text=True, timeout=30)
        pid = int((tmp_path / "w@127.0.0.1_22.pid").read_text())
        try:
            assert p.returncode == want_rc, (cmd, p.stdout, p.stderr)
            got = p.stdout.split()[-1] if want_rc == 0 else start_failure(p.stderr)
            assert got == want, (cmd, p.stdout, p.stderr)
            if "stopped" in want:
                deadline = time.monotonic() + 10
                while _running(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)  # the TERM'd group exits asynchronously
                assert not _running(pid)
        finally:
            subprocess.run(["sh", "-c", kill_script(h, "w", str(tmp_path))],
                           capture_output=True, timeout=30)
