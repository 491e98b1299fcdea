"""The hivemind DHT a replica (or a bare `scripts/dht_node.py` node) runs: a bounded start
that names unreachable initial peers, the run id, and the roster of live replicas (membership
without any central store). Its flags' multiaddresses are checked by formats.addresses.

Roster: every rank of the hivemind outer backend stores `(run id, stage) -> {replica: peer}`
in the DHT with an expiration of --heartbeat-timeout-s, refreshed every third of it, so a
replica that dies disappears from the roster within that time and the next round's group is
formed without waiting for it. Each entry carries its peer's membership proof
(modules.sync.hivemind_auth): an entry without a valid one (another run secret, an outsider)
is counted, named in a warning and never used. A rank that sees fewer replicas than the
plan's for longer than the matchmaking deadline says so, naming the initial peers it used
(the split-DHT guard: replicas started with disjoint initial peers form two DHTs and never
meet).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Any

from formats.errors import UserError
from modules.comm.errors import PeerError
from modules.sync.hivemind_auth import NOT_A_MEMBER

if TYPE_CHECKING:
    from modules.sync.hivemind_auth import PeerProof

DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/0"
"""Where a DHT node listens by default: every interface, a free port (the printed addresses
say which); a replica of a local run listens on LOOPBACK_LISTEN instead (`default_listen`)."""
LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"


def default_listen(initial_peers: Sequence[str]) -> list[str]:
    """A replica's --host-maddrs when none is given: this host's loopback when every initial
    peer is on it (a local run: nothing outside the host can reach its p2pd), else every
    interface (a first node, whom replicas anywhere may join, or a run across hosts)."""
    local = bool(initial_peers) and all(_on_loopback(m) for m in initial_peers)
    return [LOOPBACK_LISTEN if local else DEFAULT_LISTEN]


def _on_loopback(maddr: str) -> bool:
    """Whether a multiaddress (/ip4/A/tcp/P/...) names a loopback address."""
    parts = maddr.split("/")
    return len(parts) > 2 and ((parts[1] == "ip4" and parts[2].startswith("127."))
                               or (parts[1] == "ip6" and parts[2] == "::1"))


def first(e: BaseException) -> str:
    """The first line of an error, at most 200 characters."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


DHT_CALL_S = 30.0
"""Longest one DHT get or store may take: a lookup under load took seconds, never this long.
The answer comes from this replica's DHT process; one that died never answers, and the call
waited forever (the replica hung with its DHT process killed)."""


class DhtGone(PeerError):
    """This replica's DHT process (and its p2pd) ended: its outer sync cannot go on."""


def dht_call(dht: Any, method: str, *args: Any, timeout_s: float = DHT_CALL_S,
             **kwargs: Any) -> Any:
    """`dht.<method>(*args, **kwargs)` (get, store) within `timeout_s`: DhtGone at once when
    the DHT process has ended, PeerError when it is alive but does not answer in time."""
    future = getattr(dht, method)(*args, return_future=True, **kwargs)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return future.result(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except FutureTimeout:
            if not dht.is_alive():
                raise DhtGone(f"this replica's DHT process (pid {dht.pid}) ended (exit code "
                              f"{dht.exitcode}) while its outer sync needed it; nothing of "
                              "the hivemind backend works without it") from None
            if time.monotonic() >= deadline:
                raise PeerError(f"DHT {method}: no answer from this replica's DHT process "
                                f"(pid {dht.pid}) within {timeout_s:g} s: it is alive but "
                                "stuck (stopped, or starved of CPU)") from None


def start_dht(initial_peers: list[str], host_maddrs: list[str], announce_maddrs: list[str],
              client_mode: bool, timeout_s: float, flag: str = "--initial-peers",
              identity_path: str | None = None) -> Any:
    """A started hivemind DHT (its p2pd included), or UserError within `timeout_s` naming the
    initial peers that could not be reached (exit 2). It signs and checks owned records
    (`owner_tag`): only their writer can change them, in every node of the run."""
    from hivemind import DHT
    from hivemind.dht.crypto import RSASignatureValidator

    kwargs: dict[str, Any] = {"host_maddrs": host_maddrs or [DEFAULT_LISTEN],
                              "client_mode": client_mode, "startup_timeout": timeout_s,
                              "record_validators": [RSASignatureValidator()]}
    if announce_maddrs:
        kwargs["announce_maddrs"] = announce_maddrs
    if identity_path:
        kwargs["identity_path"] = identity_path
    dht = DHT(initial_peers=initial_peers or None, start=True, await_ready=False, **kwargs)
    try:
        dht.wait_until_ready(timeout=timeout_s)
    except BaseException as e:  # noqa: BLE001 - P2PDaemonError, TimeoutError, interrupt
        _stop(dht)
        if isinstance(e, KeyboardInterrupt):
            raise
        peers = ", ".join(initial_peers) or "(none)"
        raise UserError(f"{flag}: could not join the DHT through {peers} within {timeout_s:g} s "
                        f"({first(e)}); is that node running and reachable from here?") from None
    return dht


def owner_tag() -> bytes:
    """This process's `[owner:<RSA public key>]` (hivemind's RSASignatureValidator, the key
    start_dht's DHT signs with): a DHT subkey holding it can be written by this process only,
    so nobody can hide a replica's roster entry under a record of their own."""
    from hivemind.dht.crypto import RSASignatureValidator

    return RSASignatureValidator().local_public_key


def _stop(dht: Any) -> None:
    with contextlib.suppress(Exception):  # the process may not have started at all
        dht.shutdown()


_GUARDED = False


def install_orphan_guard(poll_s: float = 1.0) -> None:
    """Make the hivemind processes this rank forks (DHT, averager) stop their p2pd and exit
    when the rank dies without cleaning up (kill -9, or SIGTERM's emergency exit during
    training): each watches its parent from a thread. Ctrl+C stops them through
    HivemindOuter.close instead."""
    global _GUARDED
    if _GUARDED:
        return
    _GUARDED = True
    os.register_at_fork(after_in_child=lambda: _watch_parent(poll_s))


def _watch_parent(poll_s: float) -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        for pid in _children("p2pd"):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        os._exit(1)

    threading.Thread(target=watch, name="orphan-guard", daemon=True).start()


def _children(name: str, parent: int | None = None) -> list[int]:
    """Pids of the children called `name` of `parent` (default: this process), from /proc."""
    me, out = str(parent or os.getpid()), []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError):
            if (entry.name.isdigit() and (entry / "comm").read_text().strip() == name
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == me):
                out.append(int(entry.name))  # stat's 4th field: the parent's pid
    return out


def stop_now(pids: Sequence[int]) -> None:
    """The emergency exit of a rank (SIGTERM, a fatal error; it os._exits next): stop its
    hivemind processes `pids` (DHT, averager) and their p2pd at once, with nothing printed.

    Why not their own shutdown, or the orphan guard alone: hivemind's processes pass every
    MPFuture's result pipe to each other by SCM_RIGHTS through multiprocessing's
    resource_sharer, whose receiving side connects back to the *sending* process's listener
    thread after the message arrived. A process that dies (os._exit, or os._exit noticed by
    the guard up to a second later, one process at a time) between a send and that fetch
    leaves the other with an EOFError inside multiprocessing (the DHT process's loop dies
    with "Process DHT-1: Traceback ... resource_sharer.py"), or with a traceback from the
    listener thread (sys.excepthook). Here no process can see another die: both are first
    stopped (SIGSTOP: frozen, their sockets still open), their p2pd told to stop (SIGTERM;
    its connections close, so peers see this replica leave now), then both killed."""
    import multiprocessing.util

    # this process's own resource_sharer thread stays silent when a stopped peer's pending
    # fetch breaks: it reports errors only while multiprocessing.util.is_exiting() is False,
    # which is what the interpreter's own exit sets first (this process is exiting)
    multiprocessing.util._exiting = True
    _signal(pids, signal.SIGSTOP)
    _signal([daemon for pid in pids for daemon in _children("p2pd", pid)], signal.SIGTERM)
    _signal(pids, signal.SIGKILL)


def _signal(pids: Sequence[int], sig: int) -> None:
    """Send `sig` to each of `pids` (one already gone is skipped)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def hand_over_fds(timeout_s: float = 2.0) -> None:
    """In a hivemind process that is about to exit on its own (the averager after its
    shutdown): wait, at most `timeout_s`, until the other processes have collected every
    file descriptor it offered them, then stop its resource_sharer thread.

    Each DHT call sends an MPFuture whose result pipe travels by SCM_RIGHTS through
    multiprocessing's resource_sharer: the receiver (the DHT process) fetches it from this
    process's listener after reading the message. The averager's last calls (matchmaking
    cancelled by the shutdown declares it is no longer looking) are often still unfetched
    when its process ends; the DHT process then connects to a listener that died with the
    connection pending and its loop dies with an EOFError ("Process DHT-1: Traceback ...
    resource_sharer.py"). Stopping the thread after the wait lets the transfer in progress
    finish (it serves connections one at a time) and closes the listener before exiting."""
    from multiprocessing import resource_sharer

    pending = getattr(resource_sharer._resource_sharer, "_cache", {})  # key -> fd offered
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        time.sleep(0.01)
    resource_sharer.stop(timeout=timeout_s)


def visible_maddrs(dht: Any) -> list[str]:
    """The addresses other replicas can pass as --initial-peers to reach this one."""
    return [str(a) for a in dht.get_visible_maddrs()]


def run_id(agreed: dict[str, Any], override: str | None = None) -> str:
    """The id every replica of one run agrees on: --run-id, else a hash of what they must
    share (the plan and the payload): the same plan file gives the same id, another plan or
    payload never matches."""
    if override:
        return override
    text = json.dumps(agreed, sort_keys=True, default=str)
    return "st" + hashlib.sha256(text.encode()).hexdigest()[:16]


LINK_TIMEOUT_S = 5.0
"""Longest wait for a direct connection to a replica of the roster."""


async def _connect(peer: str, maddrs: list[str], dht: Any, node: Any) -> None:
    """In the DHT process: connect its p2pd to `peer` at `maddrs`."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    # p2pd takes the transport part only: /ip4/A/tcp/P, without /p2p/<peer id>
    await node.p2p._client.connect(PeerID.from_base58(peer),
                                   [Multiaddr(m.split("/p2p/")[0]) for m in maddrs])


IGNORED_KEPT = 10_000
"""Most distinct garbage records a roster counts (an outsider may write without end)."""


class Roster:
    """This rank's entry in the DHT's roster of live replicas of its part of the model (a
    stage, or a stage's shard), refreshed in a thread, and the roster as others wrote it (see
    the module docstring)."""

    def __init__(self, dht: Any, run: str, part: int | str, replica: int, ttl_s: float,
                 log: Callable[[str], None] = print, client_mode: bool = False,
                 identity: str = "", proof: PeerProof | None = None) -> None:
        """`part`: what the replicas in this roster average together (HivemindOuter.part);
        `identity`: its fingerprint (modules.sync.hivemind_checks.part_identity), which every
        entry carries: an entry of another identity is another run on this --run-id;
        `proof`: the run's membership proofs (None: every well-formed entry counts, as in
        tests of the roster alone)."""
        self.dht, self.key, self.replica, self.ttl_s, self.log = (
            dht, f"{run}_roster_s{part}", replica, ttl_s, log)
        self.run, self.identity, self.proof = run, identity, proof
        self.proven: set[str] = {str(dht.peer_id)}
        """Peer ids (base58) of every entry read whose proof held (and mine): the peers whose
        declarations and states may be trusted, also after their entry expired."""
        self.unproven: dict[str, str] = {}
        """Subkey -> the peer id claimed, of entries whose proof did not hold (at most
        IGNORED_KEPT kept)."""
        self.ignored: set[str] = set()
        """Subkeys of records read that are no roster entries (an outsider's garbage, at most
        IGNORED_KEPT of them kept): never parsed further."""
        self.conflict: PeerError | None = None
        """Set once an entry of another run (identity) was read: `live` raises it."""
        # a --client-mode replica (behind a NAT) announces no address: dialling its LAN
        # address from outside only costs the others LINK_TIMEOUT_S (seen on the NAT lab)
        self.maddrs = [] if client_mode else visible_maddrs(dht)
        self.owner = owner_tag() if proof is not None else b""
        """My entry's subkey is `<replica><owner>`: hivemind refuses anyone else's write."""
        self.linked: set[str] = {str(dht.peer_id)}
        """Peers this rank's p2pd was told to connect to (itself: nothing to do)."""
        self.seen: dict[int, tuple[Any, float]] = {}
        """Replica -> (its entry, the entry's expiration time), from the reads so far."""
        self.read_at = float("-inf")
        """time.monotonic() of the last read of the DHT."""
        self.lock = threading.Lock()
        """`seen` is read by the rounds and by the refreshing thread."""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="dht-roster", daemon=True)

    def start(self) -> None:
        """Announce now and keep announcing until `close`."""
        self._announce()
        self.thread.start()

    def _announce(self) -> None:
        from hivemind.utils import get_dht_time

        me = str(self.dht.peer_id)
        value = [me, self.maddrs, self.identity]
        if self.proof is not None:  # bound to my subkey's owner: a copy elsewhere is no proof
            value.append(self.proof.of(me, self.owner))
        subkey = str(self.replica).encode() + self.owner if self.owner else self.replica
        dht_call(self.dht, "store", self.key, subkey=subkey, value=value,
                 expiration_time=get_dht_time() + self.ttl_s)

    def _beat(self) -> None:
        """Announce, and read the roster (so a round can start from the last read: `live`),
        every third of the entries' lifetime."""
        while not self.stop.wait(self.ttl_s / 3):
            try:
                self._announce()
                self.live()
            except (RunMismatch, DhtGone):  # the rounds raise it (`live`), once
                return
            except Exception as e:  # noqa: BLE001 - a transient DHT error; retried next beat
                self.log(f"warning: DHT roster refresh failed ({first(e)})")

    def live(self, max_age_s: float = 0.0) -> set[int]:
        """Replicas whose entry has not expired (mine included), read from the DHT unless the
        last read is younger than `max_age_s` (a DHT get took 0.1-0.2 s at each round's start
        on the lab, on the way to the all-reduce; the refreshing thread reads every third of
        the lifetime).

        An entry read once counts until its own expiration time, also when a later read
        misses it: under load a DHT get can come back empty or partial (a lookup that timed
        out), and a live replica must not flap out of the roster (that shrank the next
        group's target and logged a live replica as gone)."""
        from hivemind.utils import get_dht_time

        if time.monotonic() - self.read_at >= max_age_s:
            self._read()
        if self.conflict is not None:
            raise self.conflict
        now = get_dht_time()
        with self.lock:
            self.seen = {r: v for r, v in self.seen.items() if v[1] > now}
            return set(self.seen) | {self.replica}

    def _read(self) -> None:
        """Merge the DHT's roster into `seen`, connecting to replicas new to my p2pd."""
        found = dht_call(self.dht, "get", self.key, latest=True)
        if found is not None and isinstance(found.value, dict):
            entries = self._valid(found.value)
            self._link([v for v, _ in entries.values()])
            with self.lock:
                for r, (v, exp) in entries.items():
                    if exp > self.seen.get(r, (None, 0.0))[1]:
                        self.seen[r] = (v, exp)
        self.read_at = time.monotonic()

    def _valid(self, records: dict) -> dict[int, tuple[list, float]]:
        """Replica -> (entry, expiration) of the well-formed records of this run; the others
        counted (`ignored`, said at 1, 10, 100, ...), never parsed further; an entry without
        a valid membership proof is counted apart (`unproven`), never used; a proven entry
        of another identity sets `conflict` (an unproven one cannot stop the run)."""
        from modules.sync.hivemind_checks import roster_record

        out, before, refused = {}, len(self.ignored), len(self.unproven)
        for k, e in records.items():
            got = roster_record(k, getattr(e, "value", None))
            exp = getattr(e, "expiration_time", None)
            if got is None or not isinstance(exp, float | int):
                if len(self.ignored) < IGNORED_KEPT:
                    self.ignored.add(repr(k)[:64])
                continue
            replica, peer, maddrs, identity, proof, owner = got
            if self.proof is not None and not self.proof.holds(peer, proof, owner):
                if len(self.unproven) < IGNORED_KEPT:
                    self.unproven.setdefault(repr(k)[:200], peer)
                continue
            with self.lock:
                self.proven.add(peer)
            if identity != self.identity and self.conflict is None:
                self.conflict = RunMismatch(
                    f"--run-id {self.run}: replica {replica} (peer {peer}) in this DHT prefix "
                    f"is another run (fingerprint {identity[:16] or '(none)'}, this one "
                    f"{self.identity}): a different model, plan, sync settings or version. "
                    "Give each run its own --run-id, or start every replica from the same plan")
            if identity == self.identity:
                out[replica] = ([peer, maddrs], float(exp))
        now = len(self.ignored)
        if _grew_past_a_power_of_ten(before, now):
            self.log(f"warning: ignored {now} record(s) in the DHT roster "
                     f"{self.key} that are not this run's entries (written from outside "
                     "the run, or by another version)")
        if _grew_past_a_power_of_ten(refused, len(self.unproven)):
            example = next(iter(self.unproven.values()))
            self.log(f"warning: refused {len(self.unproven)} entr(ies) of the DHT roster "
                     f"{self.key} (e.g. one naming peer {example}): {NOT_A_MEMBER}; "
                     "they take no part in this run")
        return out

    def trusted(self) -> set[str]:
        """Peer ids (base58) of every entry read that proved its peer a member, mine included
        (live or not: a replica that left still declared what it completed)."""
        with self.lock:
            return set(self.proven)

    def peers(self, sharing: bool = False) -> set[str]:
        """Peer ids (base58) of the replicas `live` last saw, mine excluded; `sharing`: only
        those that announce addresses (a --client-mode replica shares no state)."""
        with self.lock:
            seen = dict(self.seen)
        return {str(v[0][0]) for r, v in seen.items()
                if r != self.replica and isinstance(v[0], list) and v[0]
                and (not sharing or (len(v[0]) > 1 and v[0][1]))}

    def members(self, live: set[int], mine: str, client_mode: bool
                ) -> list[tuple[str, int, bool]]:
        """(peer id, replica, --client-mode) of each of the `live` replicas whose entry
        `live` read (me: peer id `mine`), in replica order: a group every replica that read
        the same roster forms alike."""
        out = [(mine, self.replica, client_mode)] if self.replica in live else []
        with self.lock:
            seen = dict(self.seen)
        for r, (entry, _) in seen.items():
            if r in live and r != self.replica and isinstance(entry, list) and entry:
                out.append((str(entry[0]), r, not (len(entry) > 1 and entry[1])))
        return sorted(out, key=lambda m: m[1])

    def _link(self, entries: list[Any]) -> None:
        """Connect my p2pd to every replica of the roster it was not told of yet, at the
        addresses that replica announced: on the namespace lab (198.18.0.0/15, unroutable to
        libp2p) replicas that only shared an initial peer did not find each other by libp2p's
        own routing and formed no groups."""
        for entry in entries:
            if entry[0] in self.linked:
                continue
            peer, maddrs = entry
            self.linked.add(peer)  # once: a peer that accepts no connections stays so
            if not maddrs:  # --client-mode: reached through the peers that accept
                continue
            try:
                self.dht.run_coroutine(functools.partial(_connect, peer, list(maddrs)),
                                       return_future=True).result(timeout=LINK_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - hivemind's own routing may still find it
                self.log(f"warning: could not connect to replica peer {peer} at "
                         f"{', '.join(maddrs)} within {LINK_TIMEOUT_S:g} s ({first(e)})")

    def close(self) -> None:
        """Stop refreshing (the entry expires by itself)."""
        self.stop.set()


def _grew_past_a_power_of_ten(before: int, now: int) -> bool:
    """Whether a count that went from `before` to `now` is worth a warning: its first one,
    then at 10, 100, ... (an outsider may write without end; the log stays short)."""
    return now > before and (not before or len(str(before)) != len(str(now)))


class RunMismatch(PeerError):
    """Another run (another model or plan) uses this run's DHT prefix (--run-id)."""


class SplitGuard:
    """Says (once per episode) when fewer replicas than the plan's were visible for longer
    than `after_s`, naming the initial peers used."""

    def __init__(self, expected: int, after_s: float, initial_peers: list[str],
                 log: Callable[[str], None] = print) -> None:
        self.expected, self.after_s, self.peers, self.log = expected, after_s, initial_peers, log
        self.short_since: float | None = None
        self.warned = False

    def check(self, live: set[int], now: float | None = None) -> bool:
        """Record what is visible now; True (and a log line) when the guard fires."""
        now = time.monotonic() if now is None else now
        if len(live) >= self.expected:
            self.short_since, self.warned = None, False
            return False
        if self.short_since is None:
            self.short_since = now
        if self.warned or now - self.short_since <= self.after_s:
            return False
        self.warned = True
        self.log(f"warning: only replicas {sorted(live)} of the plan's {self.expected} are "
                 f"visible in the DHT for {now - self.short_since:.1f} s (> {self.after_s:g} s); "
                 f"the others are down or in another DHT (split): I joined through "
                 f"--initial-peers {','.join(self.peers) or '(none: I am a first node)'}")
        return True
