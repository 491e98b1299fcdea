"""A one-host Slurm cluster for tests: munged, slurmctld and slurmd on a private slurm.conf.

Installs slurm-wlm and munge from the system package index when they are missing and this is
root with apt (Debian: Slurm 22.05); every file (key, state, spool, logs) under one folder,
ports of its own, nothing under /etc or /run touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
PACKAGES = ("slurm-wlm", "munge")
READY_S = 30.0


def slurm_missing() -> str | None:
    """None when Slurm can run here (installing it if root and apt can), else why not."""
    if all(shutil.which(b) for b in BINARIES):
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return ("Slurm is not installed and this is not root with apt-get (apt-get install "
                "slurm-wlm munge)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    for attempt in ([], ["update"]):
        if attempt:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True,
                           timeout=300, check=False)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                           check=False)
        if p.returncode == 0 and all(shutil.which(b) for b in BINARIES):
            return None
    return f"apt-get install {' '.join(PACKAGES)} failed: {(p.stderr or p.stdout)[-300:]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(d: Path, node: str, cpus: int, ctld_port: int, d_port: int) -> str:
    """slurm.conf of one node (this host at 127.0.0.1), state and spool under `d`."""
    return f"""ClusterName=stlab
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.sock
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
KillWait=10
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@dataclass
class SlurmLab:
    """The running daemons and the environment (SLURM_CONF) that reaches them."""

    dir: Path
    node: str
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def stop(self) -> None:
        """Cancel what is left, then stop slurmd, slurmctld and munged (by their pids)."""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["scancel", "--user", "root"], env=self.env, timeout=10,
                           capture_output=True, check=False)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def start_slurm(d: Path) -> SlurmLab:
    """munged, slurmctld and slurmd on a private slurm.conf; returns once the node is idle."""
    for sub in ("munge", "state", "spool", "log"):
        (d / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    node = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    ctld_port = _free_port()
    d_port = next(p for p in iter(_free_port, None) if p != ctld_port)
    conf.write_text(slurm_conf(d, node, os.cpu_count() or 1, ctld_port, d_port))
    env = dict(os.environ, SLURM_CONF=str(conf))
    lab = SlurmLab(d, node, env)
    log = open(d / "log" / "daemons.out", "ab")  # noqa: SIM115 (the daemons' lifetime)
    m = d / "munge"
    cmds = [["munged", "-F", "-f", f"--socket={m}/munge.sock", f"--key-file={key}",
             f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
             f"--seed-file={m}/munged.seed"],
            ["slurmctld", "-D", "-i", "-f", str(conf)],
            ["slurmd", "-D", "-N", node, "-f", str(conf)]]
    try:
        for cmd in cmds:
            lab.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=d,
                                              start_new_session=True))
            if cmd[0] == "munged":
                _wait_for(lambda: (m / "munge.sock").exists(), "munged's socket", d)
        _wait_for(lambda: _node_state(env) == "idle", "the node to be idle (sinfo)", d)
    except BaseException:
        lab.stop()
        raise
    finally:
        log.close()
    return lab


def _node_state(env: dict[str, str]) -> str:
    p = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True,
                       timeout=10, check=False)
    return p.stdout.strip()


def _wait_for(ok, what: str, d: Path) -> None:
    deadline = time.monotonic() + READY_S
    while not ok():
        if time.monotonic() > deadline:
            logs = "".join(p.read_text(errors="replace")[-800:]
                           for p in sorted((d / "log").glob("*")) if p.is_file())
            raise RuntimeError(f"Slurm lab: no {what} within {READY_S:g} s; logs:\n{logs}")
        time.sleep(0.3)
