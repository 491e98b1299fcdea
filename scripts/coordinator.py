"""The coordinator of a run: hosts the rendezvous store and leads membership, so that no
training host is a single point of failure (modules/control/coordinator.py).

    python scripts/coordinator.py --listen HOST:PORT --plan plan.json [--start-timeout-s S]
    # then every rank: python dist_runner.py --plan plan.json --rank R \
    #                      --coordinator tcp://HOST:PORT ...

Run it on a host that trains nothing (e.g. the rendezvous host). The store listens on HOST:PORT
only (HOST is the address the ranks reach it at). It needs the ranks' run secret
(ST_RUN_SECRET or ST_RUN_SECRET_FILE, else ~/.config/st-runtime/run_secret; docs/security.md).
It serves one launch and exits 0 once every rank of the newest generation finished, 1 when
the run stopped or every rank was lost (2 on bad input). If it dies or freezes, every rank
saves a checkpoint and exits 1 naming it: start it again, then every rank with --resume.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

# before anything imports torch: c10d's C++ stack traces stay out of our one-line errors
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

from formats import argtypes  # noqa: E402
from formats.addresses import host_port, resolve  # noqa: E402
from formats.errors import run_main  # noqa: E402
from formats.plan import load_plan  # noqa: E402

MAX_START_TIMEOUT_S = 1e8


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT` (port 0: any free one) -> (host, port); UserError naming --listen when it
    is not that or HOST does not resolve (the ranks must reach it)."""
    host, port = host_port(text.removeprefix("tcp://"), "--listen", zero_ok=True)
    resolve(host, "--listen")
    return host, port


def build_parser() -> argparse.ArgumentParser:
    """The coordinator's flags."""
    p = argparse.ArgumentParser(description="Host the rendezvous store of a run and lead its "
                                "membership, so that no training host is special.")
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="address the ranks reach the store at (it listens there only); the "
                   "ranks get --coordinator tcp://HOST:PORT")
    p.add_argument("--plan", required=True,
                   help="the ranks' plan JSON file (plan/1, or plan/2 with shard groups)")
    p.add_argument("--start-timeout-s", type=argtypes.number(0, MAX_START_TIMEOUT_S, lo_open=True),
                   default=600.0,
                   help="exit 1 when no rank started training this long after the first rank "
                   "checked in (default 600)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Listen, wait for the ranks, lead the run; returns the exit status."""
    args = build_parser().parse_args(argv)
    host, port = parse_listen(args.listen)
    plan = load_plan(args.plan)
    from modules.control.coordinator import Coordinator, CoordinatorConfig

    log = lambda msg: print(f"coordinator: {msg}", flush=True)
    coord = Coordinator(CoordinatorConfig(host, port, plan, args.plan, args.start_timeout_s,
                                          log))
    port = coord.listen()
    try:
        # before the line a supervisor waits for: a SIGTERM right after it finds the handler
        signal.signal(signal.SIGTERM, _on_term)
        log(f"listening on port {port} ({host} only) for {args.plan} ({plan.num_replicas} "
            f"replicas x {plan.num_stages} stage(s), sync {plan.sync.mode}); start every rank "
            f"with --coordinator tcp://{host}:{port}")
        return coord.serve()
    except SystemExit:
        log("stopped by SIGTERM: every rank will save a checkpoint and exit 1 (restart the "
            "coordinator, then the ranks with --resume)")
        # serve() has unwound; end here: the interpreter's teardown resets signal handlers to
        # the default, and a second SIGTERM during it would end the process as -15
        sys.stderr.flush()
        os._exit(143)
    finally:  # a SIGTERM from here on (the interpreter's exit included) ends quietly
        signal.signal(signal.SIGTERM, lambda *_: os._exit(143))


def _on_term(*_: object) -> None:
    """The first SIGTERM stops serve() (SystemExit, reported above); one that comes while
    that report or the exit runs ends the process at once, never as a SystemExit traceback
    from wherever the main thread was (a thread's join at exit, say)."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    raise SystemExit(143)


def entry() -> None:
    """Console entry point (setup.py): run main() under run_main."""
    run_main(main)


if __name__ == "__main__":
    entry()
