"""Fuzz every entry point with malformed flags and files (testkit/fuzz_entry_points.py,
testkit/fuzz_random.py, testkit/fuzz_runs.py and testkit/fuzz_files.py make the cases from the
building blocks of testkit/fuzz.py).

Each case must end with exit status 2, an `error:` message naming the flag or field at fault,
no traceback, and nothing written in the folder it ran in. The cases run in this process
(each program's `main(argv)` under formats.errors.run_main, as its script runs it), with the
step that would act (rendezvous, namespaces, SSH, sockets served) replaced by a tripwire that
counts as "accepted bad input"; a seeded sample of them also runs as real processes to show
the same end to end. The counts are printed at the end of the module ("bad inputs tried ...,
tracebacks seen: 0").
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import io
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from formats.errors import run_main
from testkit.fuzz import DEFAULT_SEED, ENTRY_POINTS, Case, Fifo, Folder, Link, Sparse
from testkit.fuzz_files import all_base_scenarios, all_cases

ROOT = Path(__file__).resolve().parent.parent
CASES = all_cases(DEFAULT_SEED)
BY_ENTRY: dict[str, list[Case]] = defaultdict(list)
for _case in CASES:
    BY_ENTRY[_case.entry].append(_case)
PROCESS_SAMPLE_PER_ENTRY = 2
"""Cases per entry point that also run as real processes (each costs an interpreter start)."""
CASE_LIMIT_S = 20.0
"""Longest a case may run in this process: a refused input takes milliseconds; one that runs
this long was accepted and is doing real work (a search, a huge allocation)."""
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)
ENV_CLEARED = ("PUNCH_TOKEN", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


class Acted(Exception):
    """The program got past its checks and was about to act: the bad input was accepted."""


class TookTooLong(Exception):
    """The case ran past CASE_LIMIT_S: the bad input was accepted and set real work going."""


def _acted(*args: object, **kwargs: object) -> None:
    raise Acted


def _too_long(signum: int, frame: object) -> None:
    raise TookTooLong


GUARDS: dict[str, tuple[str, ...]] = {
    "dist_runner": ("modules.control.dist.rendezvous",),
    "launch_local": ("scripts.launch_local.install_stop_handlers",
                     "scripts.launch_local.start_rank"),
    "local_cluster": ("scripts.netemu.netns.create", "scripts.netemu.netns.destroy",
                      "scripts.local_cluster.show_local", "scripts.netemu.probe.probe_local"),
    "tc": ("scripts.netemu.remote.run_remote", "scripts.tc.apply_local", "scripts.tc.show_local",
           "scripts.tc.reset_local"),
    "cluster_ssh": tuple(f"scripts.netemu.sshctl.{f}" for f in
                         ("accept_keys", "run", "start", "kill", "sync", "collect")),
    "coordinator": ("modules.control.coordinator.Coordinator.listen",),
    "delay_line": ("scripts.delay_line.serve", "scripts.delay_line.cleanup"),
    "rendezvous_server": ("udp_hole_punching_test.rendezvous_server.RendezvousServer.serve",),
    "peer": ("udp_hole_punching_test.puncher.Puncher.register",),
    "send_recv_test": ("udp_hole_punching_test.send_recv_test.run",),
}
"""Per entry point: the functions that act once the input is checked; a case reaching one
fails as "accepted"."""


@dataclass
class Outcome:
    """How one case ended."""

    code: int | str
    """Exit status, or "acted" / "traceback"."""
    stderr: str
    written: list[str] = field(default_factory=list)
    traceback: str = ""


def make_files(case: Case, folder: Path) -> None:
    """Create the case's input files in `folder`."""
    for name, content in case.files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Folder):
            path.mkdir()
        elif isinstance(content, Fifo):
            os.mkfifo(path)
        elif isinstance(content, Link):
            path.symlink_to(content.target)
        elif isinstance(content, Sparse):
            with path.open("wb") as f:
                f.truncate(content.size)
        else:
            path.write_bytes(content)


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of everything under `folder`."""
    out = {}
    for path in folder.rglob("*"):
        st = path.lstat()
        out[str(path.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return out


def changes(before: dict, after: dict) -> list[str]:
    """Paths created, removed or modified between two snapshots."""
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))


@contextlib.contextmanager
def isolated(folder: Path):
    """Run in `folder` with the process's signal handlers and environment restored after."""
    cwd, env = os.getcwd(), dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in SIGNALS}
    for name in ENV_CLEARED:
        os.environ.pop(name, None)
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        for s, h in handlers.items():
            signal.signal(s, h)


def run_in_process(case: Case, folder: Path, monkeypatch: pytest.MonkeyPatch) -> Outcome:
    """Run the case's `main(argv)` here, as its script would, with the tripwires set."""
    main = importlib.import_module(ENTRY_POINTS[case.entry].module).main
    make_files(case, folder)
    before = snapshot(folder)
    err = io.StringIO()
    tb = ""
    with monkeypatch.context() as mp, isolated(folder):
        for target in GUARDS.get(case.entry, ()):
            mp.setattr(target, _acted)
        signal.signal(signal.SIGALRM, _too_long)
        signal.setitimer(signal.ITIMER_REAL, CASE_LIMIT_S)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                run_main(main, list(case.argv))
            code: int | str = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except (Acted, TookTooLong) as e:
            code = "acted" if isinstance(e, Acted) else "too long"
        except BaseException:  # noqa: BLE001 - what the fuzz looks for
            code, tb = "traceback", traceback.format_exc()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return Outcome(code, err.getvalue(), changes(before, snapshot(folder)), tb)


def run_as_process(case: Case, folder: Path) -> Outcome:
    """Run `python SCRIPT argv` in `folder` (nothing is stubbed: real validation only)."""
    make_files(case, folder)
    before = snapshot(folder)
    env = {k: v for k, v in os.environ.items() if k not in ENV_CLEARED}
    r = subprocess.run([sys.executable, str(ROOT / ENTRY_POINTS[case.entry].script),
                        *case.argv], cwd=folder, env=env, capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    code: int | str = "traceback" if "Traceback (most recent call last)" in r.stderr \
        else r.returncode
    return Outcome(code, r.stderr, changes(before, snapshot(folder)))


def error_text(stderr: str) -> str:
    """The error message: from the first `error:` on (argparse's usage lines left out)."""
    at = stderr.find("error:")
    return stderr[at:] if at >= 0 else ""


def problems(case: Case, out: Outcome) -> list[str]:
    """What is wrong with how the case ended (empty: exit 2, named, no traceback, no file)."""
    found = []
    if out.code == "traceback":
        tail = (out.traceback or out.stderr).strip().splitlines()[-1:]
        found.append(f"traceback: {tail}")
    elif out.code == "acted":
        found.append("accepted: went on to act")
    elif out.code == "too long":
        found.append(f"accepted: still running after {CASE_LIMIT_S:g} s")
    elif out.code != 2:
        found.append(f"exit {out.code}")
    message = error_text(out.stderr)
    refused = out.code not in ("traceback", "acted", "too long")
    if refused and not any(n in message for n in case.names):
        found.append(f"message names none of {list(case.names)}: {message.strip()[:160]!r}")
    written = [p for p in out.written
               if not any(fnmatch.fnmatchcase(p, pat) for pat in case.may_write)]
    if written:
        found.append(f"wrote {written}")
    return found


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest):
    """Counts across the module's tests, printed at its end."""
    counts: Counter = Counter()
    yield counts
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    line = (f"fuzz: {counts['cases']} bad inputs tried at {counts['entries']} entry points "
            f"({counts['processes']} of them also as real processes), tracebacks seen: "
            f"{counts['tracebacks']}, other problems: {counts['problems']}, "
            f"{counts['seconds']:.1f} s")
    if reporter is None or capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():  # shown also when the tests pass
        reporter.write_line("")
        reporter.write_line(line)


def _report(entry: str, failures: list[tuple[Case, list[str]]]) -> str:
    lines = [f"{len(failures)} {entry} case(s) failed:"]
    lines += [f"  {case.label}: {'; '.join(p)}"[:300] for case, p in failures[:60]]
    return "\n".join(lines)


def test_the_suite_is_large_and_covers_every_entry_point() -> None:
    assert len(CASES) >= 200
    assert set(BY_ENTRY) == set(ENTRY_POINTS)
    assert all(case.names for case in CASES)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_bad_input_exits_2_naming_it_without_traceback_or_files(
        entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tally: Counter) -> None:
    t0 = time.monotonic()
    failures = []
    for i, case in enumerate(BY_ENTRY[entry]):
        folder = tmp_path / str(i)
        folder.mkdir()
        out = run_in_process(case, folder, monkeypatch)
        found = problems(case, out)
        tally["tracebacks"] += out.code == "traceback"
        tally["problems"] += bool(found) and out.code != "traceback"
        if found:
            failures.append((case, found))
    tally["cases"] += len(BY_ENTRY[entry])
    tally["entries"] += 1
    tally["seconds"] += time.monotonic() - t0
    if failures:
        pytest.fail(_report(entry, failures), pytrace=False)


def test_the_newer_cases_break_command_lines_that_are_accepted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each valid command line testkit/fuzz_runs.py breaks runs to the end or reaches the step
    that acts, so each of its cases is refused for its own mistake."""
    from scripts.netemu.shell import missing_root_tools
    from scripts.netemu.sshd import sshd_missing

    refused = []
    for i, s in enumerate(all_base_scenarios()):
        if s.entry == "local_cluster" and (sshd_missing() or
                                           missing_root_tools(("ip", "tc", "iptables"))):
            continue  # refused for the machine; the --sshd file check comes before that one
        folder = tmp_path / str(i)
        folder.mkdir()
        out = run_in_process(Case(s.entry, s.argv, s.files, ("-",), "valid"), folder,
                             monkeypatch)
        if out.code not in (0, "acted"):
            refused.append(f"{s.entry} {' '.join(s.argv)}: {out.code} "
                           f"{(out.traceback or out.stderr).strip()[-300:]}")
    assert refused == []


def process_sample(seed: int = DEFAULT_SEED) -> list[Case]:
    """A seeded sample of PROCESS_SAMPLE_PER_ENTRY cases per entry point."""
    rng = random.Random(seed)
    return [c for entry in sorted(BY_ENTRY)
            for c in rng.sample(BY_ENTRY[entry], PROCESS_SAMPLE_PER_ENTRY)]


def test_a_sample_as_real_processes(tmp_path: Path, tally: Counter) -> None:
    t0 = time.monotonic()
    sample = process_sample()
    folders = [tmp_path / str(i) for i in range(len(sample))]
    for folder in folders:
        folder.mkdir()
    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(run_as_process, sample, folders))
    failures = [(c, p) for c, o in zip(sample, outcomes) if (p := problems(c, o))]
    tally["processes"] += len(sample)
    tally["tracebacks"] += sum(o.code == "traceback" for o in outcomes)
    tally["seconds"] += time.monotonic() - t0
    if failures:
        pytest.fail(_report("process", failures), pytrace=False)
