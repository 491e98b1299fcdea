"""Apply, read back and reset tc rules on hosts reached through a command runner.

A runner executes one argv on host k (locally through `ip netns exec`, remotely over SSH) and
returns (exit status, stdout, stderr). Kernels without sch_netem answer the netem leaf with
"Specified qdisc kind is unknown": the rules are then re-applied without netem leaves and the
caller must add delay another way (delay line) or report it as not applied.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from formats.errors import UserError
from scripts.netemu.tcrules import (
    HostRules,
    apply_commands,
    format_delay,
    format_rate,
    reset_commands,
)

Runner = Callable[[int, list[str]], tuple[int, str, str]]
NO_NETEM_MARKERS = ("Specified qdisc kind is unknown", 'Unknown qdisc "netem"',
                    "qdisc 'netem' not supported")
RESET_HARMLESS = ("Cannot delete qdisc with handle of zero", "No such file or directory",
                  "Cannot find specified qdisc")


@dataclass
class ApplyResult:
    """What one host ended up with."""

    host: int
    netem: bool
    """True when netem leaves carry the delay; False when the caller must handle delay."""
    delays_wanted: bool
    notes: list[str] = field(default_factory=list)


def reset_host(run: Runner, rules: HostRules) -> list[str]:
    """Delete the root qdisc; returns notes for unexpected errors (none when nothing was there)."""
    notes = []
    for argv in reset_commands(rules.iface):
        rc, _, err = run(rules.host.index, argv)
        if rc != 0 and not any(m in err for m in RESET_HARMLESS):
            notes.append(f"host {rules.host.index}: `{shlex.join(argv)}`: {err.strip()}")
    return notes


def _run_all(run: Runner, host: int, cmds: list[list[str]]) -> tuple[bool, str]:
    for argv in cmds:
        rc, _, err = run(host, argv)
        if rc != 0:
            return False, f"`{shlex.join(argv)}` failed: {err.strip()}"
    return True, ""


def apply_host(run: Runner, rules: HostRules, try_netem: bool = True) -> ApplyResult:
    """Reset, then install `rules`; falls back to no netem leaves when the kernel lacks netem."""
    h = rules.host.index
    wanted = any(c.delay_ms > 0 for c in rules.classes)
    notes = reset_host(run, rules)
    ok, err = _run_all(run, h, apply_commands(rules, netem=try_netem and wanted))
    if ok:
        return ApplyResult(h, try_netem and wanted, wanted, notes)
    if not (try_netem and wanted and any(m in err for m in NO_NETEM_MARKERS)):
        reset_host(run, rules)
        raise UserError(f"host {h} ({rules.host.address}): {err}")
    reset_host(run, rules)
    ok, err2 = _run_all(run, h, apply_commands(rules, netem=False))
    if not ok:
        reset_host(run, rules)
        raise UserError(f"host {h} ({rules.host.address}): {err2}")
    notes.append(f"host {h}: kernel has no sch_netem ({err.rsplit('failed: ', 1)[-1]})")
    return ApplyResult(h, False, wanted, notes)


_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate_bits(text: str) -> float:
    """tc's printed rate (`523Kbit`, `1.12Gbit`, `100bit`) in bit/s."""
    m = re.fullmatch(r"([0-9.]+)([KMGT]?bit)", text, re.I)
    if not m:
        raise ValueError(f"unrecognised tc rate {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


@dataclass
class LiveHost:
    """What tc reports on one host."""

    classes: dict[int, float]
    """minor -> rate bit/s."""
    netem_ms: dict[int, float]
    """parent class minor -> netem delay ms."""
    filters: dict[str, int]
    """destination address -> class minor."""
    root_htb: bool


def read_live(run: Runner, host: int, iface: str) -> LiveHost:
    """Parse `tc class/qdisc/filter show` of `iface` on host `host`."""
    _, cls_out, _ = run(host, ["tc", "class", "show", "dev", iface])
    classes = {int(m.group(1), 16): parse_rate_bits(m.group(2)) for m in re.finditer(
        r"class htb 1:([0-9a-f]+) .*?\brate (\S+)", cls_out)}
    classes.pop(1, None)
    _, q_out, _ = run(host, ["tc", "-j", "qdisc", "show", "dev", iface])
    try:
        qdiscs = json.loads(q_out or "[]")
    except json.JSONDecodeError:
        qdiscs = []
    root = any(q.get("kind") == "htb" and q.get("root") for q in qdiscs)
    netem = {}
    for q in qdiscs:
        if q.get("kind") == "netem" and str(q.get("parent", "")).startswith("1:"):
            d = q.get("options", {}).get("delay", {})
            secs = d.get("delay", 0.0) if isinstance(d, dict) else float(d or 0.0)
            netem[int(q["parent"].split(":")[1], 16)] = float(secs) * 1000.0
    _, f_out, _ = run(host, ["tc", "filter", "show", "dev", iface])
    filters = {}
    for m in re.finditer(r"flowid 1:([0-9a-f]+).*?\n\s+match ([0-9a-f]{8})/ffffffff at 16",
                         f_out, re.S):
        v = int(m.group(2), 16)
        filters[".".join(str((v >> s) & 255) for s in (24, 16, 8, 0))] = int(m.group(1), 16)
    return LiveHost(classes, netem, filters, root)


def line_delays_of(cmdline: str) -> dict[str, float] | None:
    """{source: ms} that a running delay line holds, read from its command line (the `--delays`
    JSON, also found inside a `sh -c '...'`/sudo wrapper); None when it is not a delay line."""
    m = re.search(r"--delays '?(\{[^{}]*\})", cmdline) if "delay_line.py" in cmdline else None
    try:
        return {str(a): float(v) for a, v in json.loads(m.group(1)).items()} if m else None
    except (ValueError, TypeError, AttributeError):
        return None


def sender_line_delays(addresses: list[str], lines: list[dict[str, float] | None], i: int
                       ) -> dict[str, float]:
    """{receiver address: ms} that the receivers' running delay lines (`lines[j]`, read back;
    None where none runs) hold for packets from host i."""
    return {addresses[j]: d[addresses[i]] for j, d in enumerate(lines)
            if j != i and d and addresses[i] in d}


def dest_delays(rules: HostRules, live: LiveHost, line_by_dest: dict[str, float] | None
                ) -> dict[str, tuple[float, str]]:
    """Per destination: the delay (ms) its traffic really gets and how (netem, delay-line, both
    or none). `line_by_dest`: delay the receivers' running delay lines hold for this sender."""
    out = {}
    for c in rules.classes:
        for a in c.dest_addresses:
            parts = [(live.netem_ms[c.minor], "netem")] if c.minor in live.netem_ms else []
            if line_by_dest and a in line_by_dest:
                parts.append((line_by_dest[a], "delay-line"))
            out[a] = (sum(d for d, _ in parts), "+".join(h for _, h in parts) or "none")
    return out


def compare(rules: HostRules, live: LiveHost, line_by_dest: dict[str, float] | None
            ) -> tuple[list[list[str]], bool]:
    """Rows (class, dests, rate want/live, delay want/live, verdict) and whether all match.

    `line_by_dest` is the delay the receivers' running delay lines hold per destination (read
    back from them), or None when only netem counts. A class shows its worst destination."""
    rows, all_ok = [], live.root_htb
    got_by_dest = dest_delays(rules, live, line_by_dest)
    for c in rules.classes:
        got_rate = live.classes.get(c.minor)
        rate_ok = got_rate is not None and abs(got_rate - c.rate_kbit * 1e3) <= 0.01 * (
            c.rate_kbit * 1e3)
        filt_ok = all(live.filters.get(a) == c.minor for a in c.dest_addresses)
        got_delay, how = max((got_by_dest[a] for a in c.dest_addresses),
                             key=lambda g: abs(g[0] - c.delay_ms))
        delay_ok = abs(got_delay - c.delay_ms) <= 0.01
        ok = rate_ok and filt_ok and delay_ok
        all_ok &= ok
        rows.append([c.classid, ",".join(c.dest_addresses), format_rate(c.rate_kbit),
                     "-" if got_rate is None else f"{got_rate / 1e6:g}mbit",
                     format_delay(c.delay_ms),
                     f"{format_delay(got_delay)} ({how})" if how != "none" else
                     ("NOT APPLIED" if c.delay_ms > 0 else "0ms"),
                     "ok" if ok else "MISMATCH" + ("" if filt_ok else " (filters)")])
    extra = set(live.classes) - {c.minor for c in rules.classes}
    if extra:
        all_ok = False
        rows.append([",".join(f"1:{m:x}" for m in sorted(extra)), "?", "-", "present", "-", "-",
                     "MISMATCH (unexpected classes)"])
    return rows, all_ok


def table(header: list[str], rows: list[list[str]]) -> str:
    """A plain aligned text table."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, r)).rstrip() for r in [header, *rows])
