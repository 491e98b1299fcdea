"""The run secret and the authenticated control records of the rendezvous store.

torch's TCPStore answers anyone who reaches its port. Every control record the runtime obeys
(generations and their counter, stop, done, join requests, heartbeats, the coordinator's and
the run's records, commit decisions; keys: modules.control.protocol) is therefore written as
`hmac1:<HMAC-SHA256 hex>:<value>`, the MAC taken with the run secret over the key and the value
(the key names the generation, rank or outer step, so a record cannot be moved to another
key; flags, device records and torch's own process-group keys are hidden instead:
modules.control.hidden). A record that does not verify is an outsider's (or a rank's with
another secret): it is named once in the log and read as absent, never obeyed, never parsed.
Counters a rank owns (heartbeats) only count when they grow, so replaying an old signed value
changes nothing.

The secret (docs/security.md): `ST_RUN_SECRET` (the launchers generate one per run and pass
it through the environment), else the file named by `ST_RUN_SECRET_FILE`, else
`~/.config/st-runtime/run_secret`, created with mode 0600 on first use (as Erlang's
`~/.erlang.cookie`): ranks started by hand on one host share it; on several hosts copy it or
set the variable. A secret file readable by group or others is refused. Never on a command line.
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from formats.errors import UserError
from formats.macs import mac_matches, tagged_mac

SECRET_ENV = "ST_RUN_SECRET"
SECRET_FILE_ENV = "ST_RUN_SECRET_FILE"
DEFAULT_SECRET_FILE = Path("~/.config/st-runtime/run_secret")
MAX_SECRET_BYTES = 4096
MIN_SECRET_CHARS = 16
TAG = "hmac1:"


def new_secret() -> str:
    """A fresh run secret (256 random bits, hex) for a launcher to hand its ranks."""
    return secrets.token_hex(32)


def _check_secret(text: str, where: str) -> bytes:
    text = text.strip()
    if len(text) < MIN_SECRET_CHARS:
        raise UserError(f"{where}: the run secret has {len(text)} characters, fewer than "
                        f"{MIN_SECRET_CHARS}; use e.g. `python -c 'import secrets; "
                        "print(secrets.token_hex(32))'`")
    return text.encode()


def read_secret_file(path: Path) -> bytes:
    """The secret in `path`: a regular file of this user, not readable by group or others."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise UserError(f"{SECRET_FILE_ENV}: cannot open the run secret {path} "
                        f"({e.strerror})") from None
    try:  # checked on the descriptor, before fdopen (which raises IsADirectoryError)
        _check_secret_owner(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_SECRET_BYTES + 1)
    if len(data) > MAX_SECRET_BYTES:
        raise UserError(f"{SECRET_FILE_ENV}: the run secret {path} is over "
                        f"{MAX_SECRET_BYTES} bytes")
    return _check_secret(data.decode("utf-8", "replace"), str(path))


def _check_secret_owner(st: os.stat_result, path: Path) -> None:
    """UserError unless the secret is a regular file of this user that only it can read
    (root included: another user's file is no proof of this run)."""
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{SECRET_FILE_ENV}: the run secret {path} is a folder; give the file "
                        "that holds the secret")
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{SECRET_FILE_ENV}: the run secret {path} is not a regular file")
    if st.st_uid != os.getuid():
        raise UserError(f"{SECRET_FILE_ENV}: the run secret {path} belongs to user id "
                        f"{st.st_uid}, not to this user ({os.getuid()}); use a file of your own")
    if st.st_mode & 0o077:
        raise UserError(f"{SECRET_FILE_ENV}: the run secret {path} is readable by others "
                        f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 {path}")


def write_secret_file(path: Path, secret: str) -> None:
    """Create `path` holding `secret`, mode 0600 from the start (FileExistsError if present).
    Written under a temporary name and hard-linked into place, so a process starting at the
    same moment never reads it half-written."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        os.link(tmp, path)  # atomic; FileExistsError when another process was first
    finally:
        os.unlink(tmp)


def load_secret(env: dict[str, str] | None = None) -> bytes:
    """This process's run secret (see the module docstring for where it comes from)."""
    env = os.environ if env is None else env
    if env.get(SECRET_ENV):
        return _check_secret(env[SECRET_ENV], SECRET_ENV)
    if env.get(SECRET_FILE_ENV):
        return read_secret_file(Path(env[SECRET_FILE_ENV]))
    path = DEFAULT_SECRET_FILE.expanduser()
    try:
        write_secret_file(path, new_secret())
    except FileExistsError:
        pass
    except OSError as e:
        raise UserError(f"{SECRET_ENV}: no run secret set and cannot create {path} "
                        f"({e.strerror}); set {SECRET_ENV} or {SECRET_FILE_ENV}") from None
    return read_secret_file(path)


class Auth:
    """Signs and checks control records with the run secret; names forgeries once."""

    def __init__(self, secret: bytes, log: Callable[[str], None] = print) -> None:
        self._secret = secret
        self.log = log
        self.forged: list[str] = []
        """Keys at which a record failed verification (in the order seen, once each)."""
        self._seen: set[tuple[str, bytes]] = set()
        self._lock = threading.Lock()

    def _mac(self, key: str, value: bytes) -> str:
        return tagged_mac(self._secret, b"st-store/1", key.encode(), value)

    def sign(self, key: str, value: str) -> str:
        """The stored form of `value` at `key`."""
        return f"{TAG}{self._mac(key, value.encode())}:{value}"

    def name(self, key: str) -> str:
        """`key` renamed so only holders of the secret can name it (modules.control.hidden)."""
        return f"{key}/#{tagged_mac(self._secret, b'st-name/1', key.encode())[:32]}"

    def open(self, key: str, stored: bytes | str) -> str | None:
        """The value if `stored` is a record this run signed for `key`, else None (logged)."""
        raw = stored.encode() if isinstance(stored, str) else bytes(stored)
        head, _, rest = raw.partition(b":")
        mac, _, value = rest.partition(b":")
        if (head + b":" == TAG.encode()
                and mac_matches(mac.decode("ascii", "replace"), self._mac(key, value))):
            try:
                return value.decode()
            except UnicodeDecodeError:
                pass
        self._forgery(key, raw)
        return None

    def _forgery(self, key: str, raw: bytes) -> None:
        with self._lock:
            if (key, raw) in self._seen:
                return
            self._seen.add((key, raw))
            self.forged.append(key)
        self.log(f"warning: ignored a forged store record at {key!r} ({raw[:60]!r}): it is not "
                 "signed with this run's secret (an outsider wrote it, or a process started "
                 "with another ST_RUN_SECRET); not obeyed")


class AuthStore:
    """A TCPStore with signed control records: `put`/`read`/`claim`/`read_int` sign and check;
    every other call (the plain `set`, `get`, `wait`, `add`, ...) goes to the store as is.
    Process groups, arrival flags and device records go through `hidden_store(store)`
    (modules.control.hidden) instead: keys only the run can name."""

    def __init__(self, store: Any, auth: Auth) -> None:
        self.raw = store
        """The plain store (process groups and NCCL ids use it)."""
        self.auth = auth
        self.hidden: Any = None
        """The HiddenStore over `raw` (modules.control.hidden.hidden_store makes it once)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    def put(self, key: str, value: str) -> None:
        """Write a signed record."""
        self.raw.set(key, self.auth.sign(key, value))

    def read(self, key: str) -> str | None:
        """The signed record at `key`; None when absent or forged."""
        if not self.raw.check([key]):
            return None
        return self.auth.open(key, self.raw.get(key))

    def read_int(self, key: str, default: int = 0) -> int:
        """A signed integer record; `default` when absent, forged or not an integer."""
        value = self.read(key)
        try:
            return int(value) if value is not None else default
        except ValueError:
            return default

    def claim(self, key: str, value: str) -> str:
        """Set `value` unless a signed record is there already; returns the run's record
        (the first signed one wins; a forged one is replaced)."""
        expected, desired = "", self.auth.sign(key, value)
        for _ in range(100):
            got = self.raw.compare_set(key, expected, desired)
            run = self.auth.open(key, got)
            if run is not None:
                return run
            expected = got  # a forgery sits there: replace exactly it
        raise RuntimeError(f"store record {key!r} keeps being overwritten with forgeries")

    def wait_signed(self, key: str, timeout_s: float) -> str:
        """Wait until a signed record sits at `key` (RuntimeError after `timeout_s`)."""
        self.raw.wait([key], timedelta(seconds=timeout_s))
        value = self.read(key)
        if value is None:
            raise RuntimeError(f"the record at {key!r} is not signed with this run's secret")
        return value


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` only (TCPStore alone would listen on every
    interface); OSError when the address is not this host's or the port is taken."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    infos.sort(key=lambda i: i[0] != socket.AF_INET)  # "localhost": 127.0.0.1 before ::1
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


def host_store(host: str, port: int, world_size: int | None,
               timeout: timedelta) -> Any:
    """A TCPStore server listening on `host`:`port` only (port 0: any free one)."""
    import torch.distributed as dist  # here: the launchers use this module without torch

    sock = listen_socket(host, port)
    try:
        store = dist.TCPStore(host, sock.getsockname()[1], world_size, True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except (RuntimeError, OSError):
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now, for the process's life
    return store
