#!/usr/bin/env python3
"""SSH batch control of a host list (paramiko): keys, parallel commands, background runs, files.

    python scripts/cluster_ssh.py --hosts ip_list accept-keys [--replace]
    python scripts/cluster_ssh.py --hosts ip_list run -- CMD ...
    python scripts/cluster_ssh.py --hosts ip_list start --name NAME -- CMD ...
    python scripts/cluster_ssh.py --hosts ip_list kill [--name NAME]
    python scripts/cluster_ssh.py --hosts ip_list sync PATH ... --dest REMOTE_DIR
    python scripts/cluster_ssh.py --hosts ip_list collect REMOTE_PATH --dest LOCAL_DIR

ip_list: one `user@host[:port]` per line, `#` comments. Host keys are trusted only from
--known-hosts (default ./known_hosts), filled explicitly by `accept-keys`; an unknown or changed
key is refused with the host and the key's fingerprint. Commands run through the remote shell
with SCATTERED_HOST_INDEX (line number, from 0) and SCATTERED_HOST exported. `start` runs CMD in
the background under setsid and writes RUN_DIR/NAME.pid and NAME.log on each host; `kill`
signals only the process groups of those pid files. Exit status: 0 when every host succeeded,
1 otherwise (each host's status is printed).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from formats import argtypes, checks  # noqa: E402
from formats.atomic_io import check_output_dir  # noqa: E402
from formats.errors import UserError, run_main  # noqa: E402
from scripts.netemu import sshctl  # noqa: E402
from scripts.netemu.hostlist import load_host_list  # noqa: E402

MAX_SECONDS = 86400.0
MAX_PARALLEL = 1024


def _command(parts: list[str]) -> str:
    parts = parts[1:] if parts and parts[0] == "--" else parts
    if not parts:
        raise UserError("no command given (put it after --)")
    # One word: a shell snippet as typed (`'cd x && ./y'`); several: each word quoted.
    return parts[0] if len(parts) == 1 else shlex.join(parts)


def check_args(args: argparse.Namespace) -> None:
    """The subcommand's own flags, before connecting anywhere (UserError naming the flag)."""
    if getattr(args, "name", None) is not None:
        sshctl.check_name(args.name)
    if hasattr(args, "run_dir"):
        checks.text(args.run_dir, "--run-dir", max_chars=4096)
    if args.cmd in ("run", "start"):
        _command(args.command)
    if args.cmd == "sync":
        checks.text(args.dest, "--dest", max_chars=4096)
        for path in args.paths:
            if not path.exists():
                raise UserError(f"sync: {path} does not exist")
    if args.cmd == "collect":
        checks.text(args.remote, "REMOTE", max_chars=4096)
        check_output_dir(args.dest, "--dest")


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--hosts", required=True, metavar="IP_LIST", help="host list file")
    p.add_argument("--known-hosts", default="known_hosts", help="known_hosts file (known_hosts)")
    p.add_argument("--key", help="private key file (default: ssh agent and ~/.ssh keys)")
    p.add_argument("--timeout", type=argtypes.number(0, MAX_SECONDS, lo_open=True), default=10.0,
                   help="connect timeout in s (10)")
    p.add_argument("--parallel", type=argtypes.integer(1, MAX_PARALLEL), default=32,
                   help="hosts handled at once (32)")
    sub = p.add_subparsers(dest="cmd", required=True)
    ak = sub.add_parser("accept-keys", help="record the hosts' keys in --known-hosts")
    ak.add_argument("--replace", action="store_true", help="replace a changed recorded key")
    r = sub.add_parser("run", help="run CMD on every host, wait, print prefixed output")
    r.add_argument("command", nargs=argparse.REMAINDER)
    r.add_argument("--command-timeout", type=argtypes.number(0, MAX_SECONDS, lo_open=True),
                   default=None,
                   help="give up on a host after this many s without output")
    s = sub.add_parser("start", help="start CMD in the background with a pid file")
    s.add_argument("--name", required=True, help="run name (pid/log file names)")
    s.add_argument("--run-dir", default=sshctl.DEFAULT_RUN_DIR,
                   help=f"remote folder for pid and log files ({sshctl.DEFAULT_RUN_DIR})")
    s.add_argument("command", nargs=argparse.REMAINDER)
    k = sub.add_parser("kill", help="signal the runs started by `start` (by their pid files)")
    k.add_argument("--name", help="only this run (default: every pid file in --run-dir)")
    k.add_argument("--run-dir", default=sshctl.DEFAULT_RUN_DIR)
    k.add_argument("--signal", default="TERM", choices=("TERM", "INT", "KILL"))
    sy = sub.add_parser("sync", help="copy files/folders to every host (sftp)")
    sy.add_argument("paths", nargs="+", type=Path)
    sy.add_argument("--dest", required=True, help="remote folder")
    co = sub.add_parser("collect", help="copy a remote file/folder back from every host")
    co.add_argument("remote")
    co.add_argument("--dest", required=True, type=argtypes.name(4096),
                    help="local folder (one subfolder/host)")
    args = p.parse_args(argv)
    hosts = load_host_list(args.hosts)
    opt = sshctl.SSHOptions(Path(args.known_hosts), args.key, args.timeout, args.parallel)
    opt.check(args.cmd != "accept-keys", args.hosts)
    check_args(args)
    if args.cmd == "accept-keys":
        results = sshctl.accept_keys(hosts, opt, args.replace)
    elif args.cmd == "run":
        results = sshctl.run(hosts, opt, _command(args.command), args.command_timeout)
    elif args.cmd == "start":
        results = sshctl.start(hosts, opt, _command(args.command), args.name, args.run_dir)
    elif args.cmd == "kill":
        results = sshctl.kill(hosts, opt, args.name, args.run_dir, args.signal)
    elif args.cmd == "sync":
        results = sshctl.sync(hosts, opt, args.paths, args.dest)
    else:
        results = sshctl.collect(hosts, opt, args.remote, Path(args.dest))
    return 0 if sshctl.print_results(results) else 1



def entry() -> None:
    """Console entry point (setup.py): run main() under run_main."""
    run_main(main)


if __name__ == "__main__":
    entry()
