"""SSH batch control of a host list with paramiko: keys, parallel run, background runs, files.

Host keys are only ever trusted from an explicit known_hosts file filled by `accept_keys`;
normal connections use a policy that refuses an unknown key (naming the host and the key's
SHA256 fingerprint) and paramiko's check refuses a changed one. A host with a recorded key is
asked for that key type first; offering only another type counts as a changed key (an impostor
cannot slip in with a type we have not recorded), in `accept_keys` too unless --replace.
Background runs (`start`) write `RUN_DIR/NAME@HOST_PORT.pid` on the host (the pid of a `setsid`
process group) and `RUN_DIR/NAME@HOST_PORT.log`; `kill` signals exactly those process groups.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import posixpath
import secrets
import shlex
import stat
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import paramiko
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

from formats.errors import UserError
from formats.jsonfile import read_text
from scripts.netemu.hostlist import HostEntry
from scripts.netemu.shell import READY_LINE

DEFAULT_RUN_DIR = ".scattered/runs"
_print_lock = threading.Lock()
# paramiko's transport thread logs a full traceback for an unreachable host (banner error); our
# per-host FAILED line already says what happened.
logging.getLogger("paramiko").setLevel(logging.CRITICAL)


class HostKeyError(paramiko.SSHException):
    """A host key is unknown or changed; the message names the host and the fingerprint."""


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style `SHA256:...` fingerprint of a public key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class _RefuseUnknown(paramiko.MissingHostKeyPolicy):
    """RejectPolicy with a message that says what to do."""

    def __init__(self, known_hosts: Path) -> None:
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key) -> None:  # type: ignore[no-untyped-def]
        """Refuse, naming host, key type and fingerprint."""
        recorded = dict(client.get_host_keys().lookup(hostname) or {})
        if recorded:  # paramiko raises BadHostKeyException itself for this; do not rely on it
            raise HostKeyError(_changed(hostname, key, recorded, self.known_hosts))
        raise HostKeyError(
            f"{hostname}: unknown host key {key.get_name()} {fingerprint(key)} (not in "
            f"{self.known_hosts}); if you trust it, record it with `cluster_ssh.py accept-keys`")


def _listing(recorded: dict[str, paramiko.PKey]) -> str:
    return ", ".join(f"{t} {fingerprint(k)}" for t, k in recorded.items())


def _changed(name: str, key: paramiko.PKey, recorded: dict[str, paramiko.PKey],
             known_hosts: Path) -> str:
    return (f"{name}: host key CHANGED: server offers {key.get_name()} {fingerprint(key)}, "
            f"{known_hosts} has {_listing(recorded)}; refusing (possible man-in-the-middle). If "
            "the host was really re-installed, run `cluster_ssh.py accept-keys --replace`")


def _prefer_key_types(t: paramiko.Transport, recorded: list[str]) -> None:
    """Ask the server for a recorded key type first (as SSHClient.connect does), so a host that
    also has other key types is compared with the key we know."""
    opts = t.get_security_options()
    # an RSA key is recorded as ssh-rsa but negotiated as rsa-sha2-512/256
    want = [a for k in recorded for a in (("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")
                                           if k == "ssh-rsa" else (k,)) if a in opts.key_types]
    opts.key_types = want + [a for a in opts.key_types if a not in want]


@dataclass
class SSHOptions:
    """How to reach the hosts."""

    known_hosts: Path
    key_file: str | None = None
    timeout_s: float = 10.0
    parallel: int = 32

    def check(self, need_known_hosts: bool, hosts_flag: str = "IP_LIST") -> None:
        """UserError naming the flag, before connecting anywhere: --key must be a file,
        --known-hosts a file (and exist unless keys are being recorded)."""
        if self.key_file is not None and not Path(self.key_file).is_file():
            what = "is not a file" if Path(self.key_file).exists() else "does not exist"
            raise UserError(f"--key: {self.key_file} {what}")
        if self.known_hosts.exists() and not self.known_hosts.is_file():
            raise UserError(f"--known-hosts: {self.known_hosts} is not a file")
        if need_known_hosts and not self.known_hosts.exists():
            raise UserError(f"--known-hosts: {self.known_hosts} does not exist; record the "
                            f"hosts' keys first: cluster_ssh.py --hosts {hosts_flag} "
                            "accept-keys")
        if self.known_hosts.exists():
            check_known_hosts(self.known_hosts)


MAX_KNOWN_HOSTS_BYTES = 16 << 20
"""Largest known_hosts file read (~100,000 keys)."""


def check_known_hosts(path: Path) -> None:
    """UserError naming the line paramiko would fail on later (with a traceback): a marker
    line (@revoked, @cert-authority: paramiko cannot honour them) or a key it cannot parse."""
    text = read_text(path, "--known-hosts", MAX_KNOWN_HOSTS_BYTES)
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("@"):
            raise UserError(f"--known-hosts {path}:{lineno}: {stripped.split()[0]} lines are "
                            "not supported (paramiko cannot honour them, so no host is "
                            "trusted); remove the line and record plain keys with "
                            "`cluster_ssh.py accept-keys`")
        try:
            HostKeyEntry.from_line(line, lineno)
        except Exception as e:  # InvalidHostKey (args: line, cause), SSHException
            cause = e.args[-1] if isinstance(e, InvalidHostKey) and e.args else e
            why = " ".join(str(cause).split())[:120]
            raise UserError(f"--known-hosts {path}:{lineno}: not a valid host key line "
                            f"({why}); fix or remove it") from None


@dataclass
class HostResult:
    """Outcome on one host: exit status (None when not reached) plus output or error."""

    host: HostEntry
    status: int | None
    stdout: str = ""
    stderr: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        """Reached and exited 0."""
        return self.status == 0


def connect(h: HostEntry, opt: SSHOptions) -> paramiko.SSHClient:
    """An authenticated client; raises HostKeyError for an unknown or changed host key."""
    client = paramiko.SSHClient()
    if opt.known_hosts.exists():
        client.load_host_keys(str(opt.known_hosts))
    client.set_missing_host_key_policy(_RefuseUnknown(opt.known_hosts))
    try:
        client.connect(h.host, h.port, username=h.user, key_filename=opt.key_file,
                       look_for_keys=opt.key_file is None, allow_agent=opt.key_file is None,
                       timeout=opt.timeout_s, banner_timeout=opt.timeout_s,
                       auth_timeout=opt.timeout_s)
    except paramiko.BadHostKeyException as e:
        client.close()
        recorded = dict(client.get_host_keys().lookup(h.known_hosts_name()) or {})
        raise HostKeyError(_changed(h.known_hosts_name(), e.key, recorded or {
            e.expected_key.get_name(): e.expected_key}, opt.known_hosts)) from None
    except BaseException:
        client.close()
        raise
    return client


def for_all(hosts: list[HostEntry], opt: SSHOptions,
            fn: Callable[[int, HostEntry, paramiko.SSHClient], HostResult]) -> list[HostResult]:
    """Connect to every host in parallel and apply fn; failures become HostResult errors."""
    def one(k: int) -> HostResult:
        h = hosts[k]
        try:
            client = connect(h, opt)
        except HostKeyError as e:
            return HostResult(h, None, error=f"REFUSED: {e}")
        except (OSError, paramiko.SSHException) as e:
            return HostResult(h, None, error=f"unreachable: {type(e).__name__}: {e}")
        try:
            return fn(k, h, client)
        except (OSError, paramiko.SSHException) as e:
            return HostResult(h, None, error=f"failed: {type(e).__name__}: {e}")
        finally:
            client.close()
    with ThreadPoolExecutor(max_workers=max(1, min(opt.parallel, len(hosts)))) as pool:
        return list(pool.map(one, range(len(hosts))))


def host_env(k: int, h: HostEntry) -> str:
    """Shell prefix exporting SCATTERED_HOST_INDEX / SCATTERED_HOST to a remote command."""
    return f"export SCATTERED_HOST_INDEX={k} SCATTERED_HOST={shlex.quote(h.host)}; "


def exec_command(client: paramiko.SSHClient, command: str, timeout_s: float | None = None
                 ) -> tuple[int, str, str]:
    """Run `command` through the remote shell; (exit status, stdout, stderr)."""
    chan = client.get_transport().open_session()  # type: ignore[union-attr]
    chan.settimeout(timeout_s)
    chan.exec_command(command)
    out, err = chan.makefile("rb", -1), chan.makefile_stderr("rb", -1)
    # stderr in its own thread: a command that fills one stream while we read the other
    # would otherwise stall on the channel window.
    err_box: list[bytes] = []
    t = threading.Thread(target=lambda: err_box.append(err.read()), daemon=True)
    t.start()
    stdout = out.read().decode(errors="replace")
    t.join()
    stderr = b"".join(err_box).decode(errors="replace")
    return chan.recv_exit_status(), stdout, stderr


def run(hosts: list[HostEntry], opt: SSHOptions, command: str,
        timeout_s: float | None = None) -> list[HostResult]:
    """Run `command` on all hosts in parallel (SCATTERED_HOST_INDEX/SCATTERED_HOST set)."""
    def fn(k: int, h: HostEntry, c: paramiko.SSHClient) -> HostResult:
        status, out, err = exec_command(c, host_env(k, h) + command, timeout_s)
        return HostResult(h, status, out, err)
    return for_all(hosts, opt, fn)


def print_results(results: list[HostResult], file=sys.stdout) -> bool:  # type: ignore[no-untyped-def]
    """Prefixed output of every host, then one status line per host; True when all ok."""
    with _print_lock:
        for r in results:
            for stream, text in (("", r.stdout), ("!", r.stderr)):
                for line in text.splitlines():
                    print(f"[{r.host.label}]{stream} {line}", file=file)
        for r in results:
            what = f"exit {r.status}" if r.status is not None else r.error
            print(f"[{r.host.label}] {'ok' if r.ok else 'FAILED'}: {what}", file=file)
        n_ok = sum(r.ok for r in results)
        print(f"{n_ok}/{len(results)} hosts ok", file=file)
    return n_ok == len(results)


def _run_path(run_dir: str, name: str, h: HostEntry, ext: str) -> str:
    # The host is in the name: hosts that share a home folder (NFS) keep separate pid files.
    return posixpath.join(run_dir, f"{name}@{h.host}_{h.port}.{ext}")


MAX_NAME_CHARS = 64


def check_name(name: str) -> str:
    """A run name usable in file names."""
    if not name or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in name) \
            or name.startswith(".") or len(name) > MAX_NAME_CHARS:
        raise UserError(f"--name: {name[:MAX_NAME_CHARS]!r} must be 1-{MAX_NAME_CHARS} letters, "
                        "digits, '-', '_', '.' (not starting with '.')")
    return name


def start_script(k: int, h: HostEntry, command: str, name: str,
                 run_dir: str = DEFAULT_RUN_DIR, sudo: bool = False, ready_s: int = 0) -> str:
    """Shell text that starts `command` in the background with a pid file (refuses a 2nd).

    With ready_s, it then waits up to ready_s for a `ready` line in the run's log and exits 4,
    with the reason and the log's tail on stderr, when the run exits first or stays silent
    (then it is stopped: a late start must not do what was reported as not done)."""
    check_name(name)
    pid, log = _run_path(run_dir, name, h, "pid"), _run_path(run_dir, name, h, "log")
    q_pid, q_log = shlex.quote(pid), shlex.quote(log)
    inner = host_env(k, h) + command
    # setsid: the run gets its own process group, so `kill` reaches its children too.
    # (With sudo the pid is sudo's, which relays signals to the command.)
    launcher = "sudo -n setsid" if sudo else "setsid"
    kill = "sudo -n kill" if sudo else "kill"
    text = (f"mkdir -p {shlex.quote(run_dir)} && "
            f"if [ -e {q_pid} ] && {kill} -0 \"$(cat {q_pid})\" 2>/dev/null; then "
            f"echo 'run {name} is already running' >&2; exit 3; fi; "
            # truncated here, not only by the background job's own redirection (which runs
            # later): the wait below must not read the previous run's `ready`
            f": > {q_log}; {launcher} sh -c {shlex.quote(inner)} > {q_log} 2>&1 < /dev/null & "
            f"p=$!; echo $p > {q_pid}; echo started pid $p")
    if not ready_s:
        return text
    # State from /proc/PID/stat, not `kill -0`: until this shell exits the run is its child,
    # and a child that died is a zombie that `kill -0` still finds.
    return text + (
        f"; n=0; while ! grep -qx {READY_LINE} {q_log} 2>/dev/null; do "
        's=$(sed "s/.*) \\(.\\).*/\\1/" /proc/$p/stat 2>/dev/null); '
        'if [ -z "$s" ] || [ "$s" = Z ]; then echo "it exited:" >&2; '
        f"tail -n 3 {q_log} >&2; exit 4; fi; "
        f"if [ $n -ge {ready_s * 10} ]; then "
        f"{kill} -TERM -- -$p 2>/dev/null || {kill} -TERM $p 2>/dev/null; "
        f"echo 'no {READY_LINE} line within {ready_s} s (stopped it):' >&2; "
        f"tail -n 3 {q_log} >&2; exit 4; fi; "
        "sleep 0.1; n=$((n+1)); done; echo ready")


def start_failure(stderr: str) -> str:
    """One line from a failed start_script's stderr: the reason, then the log's tail."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()] or ["no output"]
    return " ".join([lines[0], " | ".join(lines[1:])]).strip().rstrip(":")


def kill_script(h: HostEntry, name: str | None = None, run_dir: str = DEFAULT_RUN_DIR,
                signal_name: str = "TERM", sudo: bool = False, wait_s: int = 10) -> str:
    """Shell text that signals the runs recorded in this host's pid files, waits up to wait_s
    for them to exit (a delay line removes its iptables rules on TERM) and removes the files."""
    if name is not None:
        check_name(name)
    pattern = shlex.quote(_run_path(run_dir, name, h, "pid")) if name else (
        shlex.quote(run_dir) + "/*" + shlex.quote(f"@{h.host}_{h.port}.pid"))
    k = "sudo -n kill" if sudo else "kill"
    # The process group (setsid) if there is one, else the pid alone (sudo relays signals).
    return (f"for f in {pattern}; do [ -e \"$f\" ] || continue; p=$(cat \"$f\"); "
            f"if {k} -{signal_name} -- -\"$p\" 2>/dev/null; then t=\"-$p\"; "
            f"elif {k} -{signal_name} \"$p\" 2>/dev/null; then t=\"$p\"; else t=; fi; "
            "if [ -n \"$t\" ]; then echo \"killed $p ($f)\"; n=0; "
            f"while {k} -0 -- \"$t\" 2>/dev/null && [ $n -lt {wait_s * 10} ]; do "
            "sleep 0.1; n=$((n+1)); done; "
            "else echo \"$p ($f) not running\"; fi; rm -f \"$f\"; done")


def start(hosts: list[HostEntry], opt: SSHOptions, command: str, name: str,
          run_dir: str = DEFAULT_RUN_DIR) -> list[HostResult]:
    """Start `command` in the background on every host (pid file and log in RUN_DIR)."""
    check_name(name)

    def fn(k: int, h: HostEntry, c: paramiko.SSHClient) -> HostResult:
        status, out, err = exec_command(c, start_script(k, h, command, name, run_dir),
                                        opt.timeout_s)
        return HostResult(h, status, out, err)
    return for_all(hosts, opt, fn)


def kill(hosts: list[HostEntry], opt: SSHOptions, name: str | None = None,
         run_dir: str = DEFAULT_RUN_DIR, signal_name: str = "TERM") -> list[HostResult]:
    """Signal the process groups recorded in this tool's pid files (all names when None)."""
    if name is not None:
        check_name(name)

    def fn(k: int, h: HostEntry, c: paramiko.SSHClient) -> HostResult:
        status, out, err = exec_command(c, kill_script(h, name, run_dir, signal_name),
                                        opt.timeout_s)
        return HostResult(h, status, out, err)
    return for_all(hosts, opt, fn)


def _put_tree(sftp: paramiko.SFTPClient, local: Path, remote: str, tag: str) -> int:
    """Copy `local` to `remote`; each file goes to a temporary name of this host (`tag`) and is
    renamed into place, so hosts sharing one filesystem (an NFS home) never see each other's
    half-written copy."""
    if local.is_dir():
        _mkdirs(sftp, remote)
        return sum(_put_tree(sftp, p, posixpath.join(remote, p.name), tag)
                   for p in sorted(local.iterdir()))
    tmp = posixpath.join(posixpath.dirname(remote), f".{posixpath.basename(remote)}.{tag}.tmp")
    try:
        sftp.put(str(local), tmp)
        sftp.chmod(tmp, local.stat().st_mode & 0o777)
        sftp.posix_rename(tmp, remote)  # atomic replace (OpenSSH's posix-rename extension)
    except BaseException:
        with contextlib.suppress(OSError):
            sftp.remove(tmp)
        raise
    return 1


def _mkdirs(sftp: paramiko.SFTPClient, remote: str) -> None:
    parts = [p for p in remote.split("/") if p]
    cur = "/" if remote.startswith("/") else ""
    for p in parts:
        cur = posixpath.join(cur, p) if cur else p
        try:
            sftp.stat(cur)
        except FileNotFoundError:
            try:
                sftp.mkdir(cur)
            except OSError:
                sftp.stat(cur)  # created meanwhile by someone else: fine; else re-raise


def sync(hosts: list[HostEntry], opt: SSHOptions, paths: list[Path], dest: str
         ) -> list[HostResult]:
    """Copy files/folders to DEST/<name> on every host over sftp."""
    for p in paths:
        if not p.exists():
            raise UserError(f"sync: {p} does not exist")

    def fn(k: int, h: HostEntry, c: paramiko.SSHClient) -> HostResult:
        with c.open_sftp() as sftp:
            _mkdirs(sftp, dest)
            tag = f"{k}-{os.getpid()}-{secrets.token_hex(4)}"
            n = sum(_put_tree(sftp, p, posixpath.join(dest, p.name), tag) for p in paths)
        return HostResult(h, 0, f"{n} file(s) -> {dest}\n")
    return for_all(hosts, opt, fn)


MAX_COLLECT_DEPTH = 32
"""Folders deeper than this under REMOTE are refused (an endless remote tree)."""
MAX_COLLECT_BYTES = 64 << 30
"""`collect` copies at most this much per host."""
MAX_COLLECT_FILES = 200_000
"""... and at most this many files per host."""


class CollectRefused(Exception):
    """A remote listing `collect` will not follow (the message says which name and why)."""


@dataclass
class _Budget:
    """What one host's `collect` may still copy."""

    bytes: int = field(default_factory=lambda: MAX_COLLECT_BYTES)
    files: int = field(default_factory=lambda: MAX_COLLECT_FILES)
    skipped: list[str] = field(default_factory=list)
    """Remote symlinks and special files, not copied."""


def _safe_child(local: Path, root: Path, name: str) -> Path:
    """`local`/`name`, refused when `name` is not one plain path component that stays under
    `root` (the scp CVE-2019-6111 class: '..', '/x', 'a/b' from a hostile server)."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise CollectRefused(f"the host listed a file named {name!r}, which would leave the "
                             "destination folder; refused")
    child = local / name
    if child.is_symlink() or not child.resolve().is_relative_to(root.resolve()):
        raise CollectRefused(f"{child} leads outside {root} (a symlink); refused")
    return child


def _get_file(sftp: paramiko.SFTPClient, remote: str, local: Path, budget: _Budget) -> None:
    """Copy one regular file to a temporary name and rename it into place (never through a
    symlink), within the byte budget."""
    local.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=f".{local.name[:100]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out, sftp.open(remote, "rb") as f:
            while chunk := f.read(min(1 << 20, budget.bytes + 1)):
                budget.bytes -= len(chunk)
                if budget.bytes < 0:
                    raise CollectRefused(f"{remote}: over the {MAX_COLLECT_BYTES} bytes "
                                         "`collect` copies from one host; refused")
                out.write(chunk)
        os.replace(tmp, local)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _get_tree(sftp: paramiko.SFTPClient, remote: str, local: Path, root: Path,
              budget: _Budget, depth: int = 0) -> int:
    """Copy `remote` to `local` (under `root`): regular files and folders only, bounded in
    depth, file count and bytes."""
    st = sftp.lstat(remote)
    mode = st.st_mode or 0
    if stat.S_ISDIR(mode):
        if depth >= MAX_COLLECT_DEPTH:
            raise CollectRefused(f"{remote}: deeper than {MAX_COLLECT_DEPTH} folders; refused")
        local.mkdir(parents=True, exist_ok=True)
        return sum(_get_tree(sftp, posixpath.join(remote, name), _safe_child(local, root, name),
                             root, budget, depth + 1)
                   for name in sorted(sftp.listdir(remote)))
    if not stat.S_ISREG(mode):  # a remote symlink or device: not followed
        budget.skipped.append(remote)
        return 0
    budget.files -= 1
    if budget.files < 0:
        raise CollectRefused(f"{remote}: over the {MAX_COLLECT_FILES} files `collect` copies "
                             "from one host; refused")
    _get_file(sftp, remote, local, budget)
    return 1


def collect(hosts: list[HostEntry], opt: SSHOptions, remote: str, dest: Path
            ) -> list[HostResult]:
    """Copy REMOTE (file or folder) from every host to DEST/<user@host_port>/<basename>;
    nothing is written outside DEST (see `_safe_child`), remote symlinks are not followed."""
    def fn(k: int, h: HostEntry, c: paramiko.SSHClient) -> HostResult:
        root = dest / f"{h.user}@{h.host}_{h.port}"
        budget = _Budget()
        with c.open_sftp() as sftp:
            try:
                root.mkdir(parents=True, exist_ok=True)
                target = _safe_child(root, root, posixpath.basename(remote.rstrip("/")) or "root")
                n = _get_tree(sftp, remote, target, root, budget)
            except FileNotFoundError:
                return HostResult(h, 1, "", f"{remote}: no such file on the host\n")
            except CollectRefused as e:
                return HostResult(h, 1, "", f"collect: {e}\n")
        skipped = (f"; {len(budget.skipped)} symlink(s)/special file(s) not copied"
                   if budget.skipped else "")
        return HostResult(h, 0, f"{n} file(s) -> {target}{skipped}\n")
    return for_all(hosts, opt, fn)


def accept_keys(hosts: list[HostEntry], opt: SSHOptions, replace: bool = False
                ) -> list[HostResult]:
    """Fetch each host's key and record it in the known_hosts file (explicit trust step).

    A host with recorded keys must offer one of them (its type is asked for first); any other
    key, of any type, is refused unless `replace`, which then drops the old keys."""
    known = paramiko.HostKeys()
    if opt.known_hosts.exists():
        known.load(str(opt.known_hosts))
    lock = threading.Lock()

    def one(k: int) -> HostResult:
        h = hosts[k]
        try:
            with paramiko.Transport((h.host, h.port)) as t:
                t.banner_timeout = opt.timeout_s
                with lock:
                    recorded = list(known.lookup(h.known_hosts_name()) or {})
                _prefer_key_types(t, recorded)
                t.start_client(timeout=opt.timeout_s)
                key = t.get_remote_server_key()
        except (OSError, paramiko.SSHException) as e:
            return HostResult(h, None, error=f"unreachable: {type(e).__name__}: {e}")
        name = h.known_hosts_name()
        with lock:
            old = dict(known.lookup(name) or {})
            if old and key not in old.values():
                if not replace:
                    return HostResult(h, None, error=(
                        f"REFUSED: {name} offers {key.get_name()} {fingerprint(key)} but "
                        f"{opt.known_hosts} has {_listing(old)}; use --replace if the host was "
                        "re-installed"))
                while name in known:  # a re-installed host: its old keys of any type go
                    del known[name]
            known.add(name, key.get_name(), key)
        verb = "unchanged" if key in old.values() else ("replaced" if old else "recorded")
        return HostResult(h, 0, f"{verb} {name} {key.get_name()} {fingerprint(key)}\n")

    with ThreadPoolExecutor(max_workers=max(1, min(opt.parallel, len(hosts)))) as pool:
        results = list(pool.map(one, range(len(hosts))))
    opt.known_hosts.parent.mkdir(parents=True, exist_ok=True)
    # a fresh private folder beside the file: no predictable temp name to plant a symlink at
    with tempfile.TemporaryDirectory(dir=opt.known_hosts.parent) as tmpdir:
        tmp = Path(tmpdir) / opt.known_hosts.name
        known.save(str(tmp))
        os.replace(tmp, opt.known_hosts)
    return results
