"""The systematic fuzz cases, one generator per entry point (GENERATORS lists them all)."""

from __future__ import annotations

from testkit.fuzz import (
    BAD_COUNT,
    BAD_HOST,
    BAD_PORT,
    BAD_POSITIVE_COUNT,
    CALIBRATION,
    CALIBRATION_FIELDS,
    CLUSTER_FIELDS,
    HOSTS,
    NETNS_MAP,
    NETNS_MAP_FIELDS,
    NON_NEGATIVE,
    NOT_FINITE,
    PLAN_FIELDS,
    POSITIVE,
    SIM_CONFIG_FIELDS,
    Case,
    Folder,
    Scenario,
    cluster_dict,
    host_list_cases,
    plan_dict,
    plan_files,
    to_json,
    with_flag,
)


def scheduler_cases() -> list[Case]:
    """`scheduler.py scenario|plan|evaluate|simulate`."""
    files = plan_files({"cal.json": to_json(CALIBRATION), "dir": Folder()})
    sc = Scenario("scheduler", ("scenario", "random", "--seed", "0", "--devices", "8",
                                "--regions", "2", "--out", "out.json"), files)
    pl = Scenario("scheduler", ("plan", "--cluster", "c.json", "--model", "gpt-tiny", "--stages",
                                "2", "--replicas", "2", "--objective", "simulated", "--budget",
                                "20", "--random-samples", "2", "--time-limit", "5",
                                "--runtime", "cpu", "--calibration", "cal.json", "--out",
                                "out.json", "--plot", "out.png", "--quiet"), files)
    ev = Scenario("scheduler", ("evaluate", "--cluster", "c.json", "--plan", "p.json",
                                "--objective", "simulated"), files)
    si = Scenario("scheduler", ("simulate", "--cluster", "c.json", "--plan", "p.json",
                                "--timeline", "t.png"), files)
    out = [
        *sc.flag("--seed", BAD_COUNT), *sc.flag("--devices", [*BAD_POSITIVE_COUNT, "1"]),
        *sc.flag("--regions", [*BAD_POSITIVE_COUNT, "9"], ("--regions", "--devices")),
        *sc.flag("--out", ["dir", "c.json/x.json", ""]),
        sc.argv_case(("scenario", "nope", "--out", "out.json"), ("nope",), "unknown scenario"),
        *pl.flag("--stages", [*BAD_COUNT, "3"], ("--stages", "--replicas")),
        *pl.flag("--replicas", [*BAD_COUNT, "3"], ("--stages", "--replicas")),
        *pl.flag("--model", ["gpt-nope", ""], ("--model", "model")),
        *pl.flag("--objective", ["x"]),
        *pl.flag("--micro-batch-size", [*BAD_POSITIVE_COUNT, "10000000000000"]),
        *pl.flag("--micro-batches", [*BAD_COUNT, "10000000000000"]),
        *pl.flag("--tokens-per-replica", POSITIVE),
        *pl.flag("--sync", ["x"]), *pl.flag("--compression", ["int4"]),
        *pl.flag("--inner-steps", [*BAD_POSITIVE_COUNT, "5"], ("--inner-steps", "inner_steps")),
        *pl.flag("--budget", BAD_POSITIVE_COUNT), *pl.flag("--time-limit", POSITIVE),
        *pl.flag("--search-seed", BAD_COUNT), *pl.flag("--random-samples", BAD_POSITIVE_COUNT),
        *pl.flag("--out", ["dir", "c.json/p.json"]), *pl.flag("--plot", ["dir", "p.txt"]),
        *pl.flag("--mfu", [*POSITIVE, "1.5"]), *pl.flag("--activation-bytes", ["3", "x"]),
        *pl.flag("--collective-latency-factor", [*NOT_FINITE, "0.5", "11"]),
        *pl.flag("--outer-store-round-trips", ["-1", "101", "x", "9" * 40]),
        *pl.flag("--recompute", ["yes"]), *pl.flag("--runtime", ["tpu", "gpu"],
                                                    ("--runtime", "runtime")),
        *pl.flag("--calibration", ["missing.json", "dir"],
                 ("--calibration", "missing.json", "dir")),
        pl.argv_case((*pl.argv, "--scenario", "lab"), ("--scenario", "--cluster"),
                     "--cluster and --scenario"),
        pl.argv_case((*pl.argv, "--seed", "1"), ("--seed",), "--seed with --cluster"),
        pl.file("c.json", to_json(cluster_dict(1)), ("device", "--stages", "cluster"),
                "a 1-device cluster"),
        *pl.whole_file("c.json", "--cluster"), *pl.whole_file("cal.json", "--calibration"),
        *pl.json_fields("cal.json", CALIBRATION, CALIBRATION_FIELDS),
        *ev.flag("--objective", ["x"]), *ev.flag("--mfu", NOT_FINITE),
        *ev.whole_file("p.json", "--plan"),
        ev.file("c.json", to_json(cluster_dict(4, memory_gb=0.5)), ("memory",),
                "a plan that does not fit in memory"),
        *si.flag("--timeline", ["dir", "t.txt"]), *si.whole_file("c.json", "--cluster"),
    ]
    return out


def scheduler_plan_field_cases() -> list[Case]:
    """Every PLAN_FIELDS and SIM_CONFIG_FIELDS mutation under `evaluate` and `simulate`."""
    files = plan_files()
    out = []
    for command in ("evaluate", "simulate"):
        s = Scenario("scheduler", (command, "--cluster", "c.json", "--plan", "p.json"), files)
        out += s.json_fields("p.json", plan_dict(), [*PLAN_FIELDS, *SIM_CONFIG_FIELDS])
    return out


def scheduler_cluster_field_cases() -> list[Case]:
    """Every CLUSTER_FIELDS mutation under `plan` (nothing may be written)."""
    s = Scenario("scheduler", ("plan", "--cluster", "c.json", "--model", "gpt-tiny", "--stages",
                               "2", "--replicas", "2", "--objective", "dtfm", "--budget", "20",
                               "--random-samples", "2", "--out", "out.json", "--quiet"),
                 plan_files())
    return s.json_fields("c.json", cluster_dict(), CLUSTER_FIELDS)


def dist_runner_cases() -> list[Case]:
    """`dist_runner.py`: every RunConfig/LaunchConfig flag, the plan and cluster files."""
    files = plan_files({"pd.json": to_json(plan_dict("diloco")), "dir": Folder(),
                         "tiny.txt": b"hello\n", "empty": Folder()})
    s = Scenario("dist_runner", ("--plan", "p.json", "--rank", "0", "--world-size", "4",
                                 "--dist-url", "tcp://127.0.0.1:29500", "--steps", "2",
                                 "--fake-data", "--metrics", "m.jsonl", "--ckpt-dir", "ck",
                                 "--timeout-s", "5"), files)
    dl = Scenario("dist_runner", with_flag(s.argv, "--plan", "pd.json"), files)
    no_fake = tuple(a for a in s.argv if a != "--fake-data")
    return [
        *s.flag("--steps", BAD_POSITIVE_COUNT), *s.flag("--seed", [*BAD_COUNT, "1" + "0" * 20]),
        *s.flag("--timeout-s", [*POSITIVE, "1e300"]), *s.flag("--log-every", BAD_POSITIVE_COUNT),
        *s.flag("--lr", POSITIVE), *s.flag("--weight-decay", NON_NEGATIVE),
        *s.flag("--warmup-steps", [*BAD_COUNT, "1" + "0" * 20]),
        *s.flag("--lr-schedule", ["x"]), *s.flag("--min-lr-ratio", [*NON_NEGATIVE, "1.5"]),
        *s.flag("--ckpt-every", BAD_COUNT), *s.flag("--keep-checkpoints", BAD_POSITIVE_COUNT),
        *s.flag("--ckpt-dir", ["p.json", "c.json/ck"]),
        *s.flag("--heartbeat-timeout-s", [*POSITIVE, "1e300"]),
        *s.flag("--eval-every", BAD_COUNT), *s.flag("--eval-sequences", [*BAD_COUNT, "9" * 15]),
        *s.flag("--metrics", ["dir", "c.json/m.jsonl", ""]),
        *s.flag("--peak-tflops", POSITIVE), *s.flag("--device", ["tpu"]),
        *s.flag("--cuda-device", [*BAD_COUNT, "9" * 20]), *s.flag("--comm", ["mpi"]),
        *s.flag("--precision", ["fp8"]), *s.flag("--threads", [*BAD_COUNT, "100000000"]),
        *s.flag("--rank", [*BAD_COUNT, "4"], ("--rank", "rank")),
        *s.flag("--world-size", [*BAD_POSITIVE_COUNT, "3"], ("--world-size", "world size")),
        *s.flag("--dist-url", ["http://127.0.0.1:29500", "tcp://", "tcp://127.0.0.1",
                               "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "tcp://:29500",
                               "tcp://a..b:29500", "tcp://127.0.0.1:x"]),
        *s.flag("--cluster", ["missing.json", "dir"], ("--cluster", "missing.json", "dir")),
        *s.flag("--coordinator", ["tcp://127.0.0.1:0", "http://x:1", "tcp://a..b:1"]),
        *s.flag("--debug-vanish", ["x", "1", "-1:2"]),
        s.argv_case(with_flag((*s.argv, "--resume"), "--ckpt-dir", None), ("--resume",),
                    "--resume without --ckpt-dir"),
        s.argv_case((*s.argv, "--join"), ("--join",), "--join on an allreduce plan"),
        s.argv_case((*s.argv, "--data", "tiny.txt"), ("--data", "--fake-data"),
                    "--data and --fake-data"),
        *[s.argv_case((*no_fake, "--data", d), ("data", d), f"--data {d}")
          for d in ("missing.txt", "empty", "tiny.txt")],
        *dl.flag("--replicas", ["a", "-1", "5", "", ",", "0,9"]),
        *dl.flag("--min-replicas", ["0", "-1", "3", "x"]),
        *s.whole_file("p.json", "--plan"),
        *s.json_fields("p.json", plan_dict(), PLAN_FIELDS),
    ]


def dist_runner_cluster_cases() -> list[Case]:
    """`dist_runner.py --cluster`: a broken cluster file."""
    s = Scenario("dist_runner", ("--plan", "p.json", "--rank", "0", "--dist-url",
                                 "tcp://127.0.0.1:29500", "--steps", "2", "--fake-data",
                                 "--cluster", "c.json", "--metrics", "m.jsonl"), plan_files())
    return [*s.whole_file("c.json", "--cluster"),
            *s.json_fields("c.json", cluster_dict(), CLUSTER_FIELDS)]


def launch_local_cases() -> list[Case]:
    """`scripts/launch_local.py`: its flags, the plan, the netns map, dist_runner's flags."""
    files = plan_files({"nm.json": to_json(NETNS_MAP), "dir": Folder()})
    s = Scenario("launch_local", ("--plan", "p.json", "--host", "127.0.0.1", "--port", "0",
                                  "--threads-per-rank", "1", "--grace-s", "1", "--",
                                  "--steps", "1", "--fake-data", "--metrics", "m.jsonl"), files)
    nm = Scenario("launch_local", with_flag(s.argv, "--netns-map", "nm.json"), files)
    return [
        *s.flag("--host", [*BAD_HOST, "192.0.2.1"]), *s.flag("--port", BAD_PORT),
        *s.flag("--threads-per-rank", [*BAD_COUNT, "100000000"]),
        *s.flag("--grace-s", NON_NEGATIVE), *s.flag("--gloo-ifname", ["", "a/b", "x" * 16]),
        *s.flag("--netns-map", ["missing.json", "dir"]),
        *s.whole_file("p.json", "--plan"),
        *nm.whole_file("nm.json", "--netns-map"),
        *nm.json_fields("nm.json", NETNS_MAP, NETNS_MAP_FIELDS),
        *[s.argv_case((*s.argv, *extra), names, f"dist_runner args {' '.join(extra)}")
          for extra, names in ((("--lr", "nan"), ("--lr",)), (("--bogus",), ("--bogus",)),
                               (("--steps", "0"), ("--steps",)),
                               (("--metrics", "dir"), ("--metrics",)),
                               (("--rank", "1"), ("--rank",)))],
    ]


def local_cluster_cases() -> list[Case]:
    """`scripts/local_cluster.py up|probe|status|down`."""
    files = plan_files({"dir": Folder(), "afile": b"x"})
    up = Scenario("local_cluster", ("up", "--cluster", "c.json", "--hosts", "2", "--group-by",
                                    "modulo", "--link-gbps", "10", "--delay", "auto",
                                    "--out-dir", "od", "--prefix", "fz"), files)
    pr = Scenario("local_cluster", ("probe", "--prefix", "fz", "--seconds", "1", "--pings", "3",
                                    "--out", "m.json"), files)
    return [
        *up.flag("--prefix", ["", "A", "x" * 20, "1a", "a-b", "a/b"]),
        *up.flag("--hosts", [*BAD_POSITIVE_COUNT, "5"]),
        *up.flag("--link-gbps", [*POSITIVE, "1e-9", "0.0001"], ("--link-gbps",)),
        *up.flag("--group-by", ["x"]), *up.flag("--delay", ["x"]),
        *up.flag("--out-dir", ["afile", "afile/sub"]),
        *up.whole_file("c.json", "--cluster"),
        *pr.flag("--seconds", POSITIVE), *pr.flag("--pings", BAD_POSITIVE_COUNT),
        *pr.flag("--out", ["dir", "afile/m.json"]),
        *[Case("local_cluster", (cmd, "--prefix", p), files, ("--prefix",), f"{cmd} {p!r}")
          for cmd in ("status", "down") for p in ("", "UP", "a/b")],
    ]


def tc_cases() -> list[Case]:
    """`scripts/tc.py apply|show|reset|probe`, over SSH and --local."""
    files = plan_files({"ip_list": HOSTS, "kh": b"", "key": b"k", "dir": Folder(),
                         "afile": b"x"})
    s = Scenario("tc", ("apply", "--cluster", "c.json", "--hosts", "ip_list", "--iface", "eth0",
                        "--link-gbps", "10", "--known-hosts", "kh", "--timeout", "5"), files)
    pr = Scenario("tc", ("probe", "--cluster", "c.json", "--hosts", "ip_list", "--known-hosts",
                         "kh", "--seconds", "1", "--out", "m.json"), files)
    lo = Scenario("tc", ("show", "--cluster", "c.json", "--local", "fz"), files)
    return [
        *s.flag("--iface", ["", "a/b", "x" * 16, "a b"]),
        *s.flag("--link-gbps", [*POSITIVE, "0.0001"]),
        *s.flag("--num-hosts", [*BAD_POSITIVE_COUNT, "3", "9" * 30], ("--num-hosts", "--hosts")),
        *s.flag("--group-by", ["x"]), *s.flag("--timeout", POSITIVE),
        *s.flag("--remote-python", ["", "a\nb"]), *s.flag("--key", ["missing", "dir"]),
        *s.flag("--known-hosts", ["dir"]), *s.flag("--delay", ["x"]),
        *pr.flag("--seconds", POSITIVE), *pr.flag("--out", ["dir", "afile/m.json"]),
        s.argv_case(with_flag(s.argv, "--hosts", None), ("--hosts", "--local"),
                    "neither --hosts nor --local"),
        s.argv_case((*s.argv, "--local", "fz"), ("--hosts", "--local"), "--hosts and --local"),
        *lo.flag("--local", ["", "A", "a/b", "x" * 20]),
        *s.whole_file("c.json", "--cluster"),
        *host_list_cases(s, "ip_list", "--hosts"),
        s.file("ip_list", b"root@10.0.0.1\nroot@10.0.0.1\nroot@10.0.0.3\nroot@10.0.0.4\n",
               ("ip_list", "distinct"), "the same address twice"),
        s.file("ip_list", b"root@a.example\nroot@10.0.0.2\nroot@10.0.0.3\nroot@10.0.0.4\n",
               ("ip_list",), "a name, not an IPv4 address"),
    ]


def cluster_ssh_cases() -> list[Case]:
    """`scripts/cluster_ssh.py` and its subcommands."""
    files = {"ip_list": HOSTS, "kh": b"", "key": b"k", "dir": Folder(), "afile": b"x"}
    head = ("--hosts", "ip_list", "--known-hosts", "kh", "--timeout", "5", "--parallel", "4")
    s = Scenario("cluster_ssh", (*head, "run", "--command-timeout", "5", "--", "true"), files)
    st = Scenario("cluster_ssh", (*head, "start", "--name", "job", "--", "sleep", "1"), files)
    co = Scenario("cluster_ssh", (*head, "collect", "logs", "--dest", "got"), files)
    sy = Scenario("cluster_ssh", (*head, "sync", "afile", "--dest", "remote"), files)
    return [
        *s.flag("--timeout", POSITIVE), *s.flag("--parallel", [*BAD_POSITIVE_COUNT, "100000"]),
        *s.flag("--key", ["missing", "dir"]), *s.flag("--known-hosts", ["missing", "dir"]),
        *s.flag("--command-timeout", POSITIVE),
        s.argv_case((*head, "run"), ("command",), "run without a command"),
        *st.flag("--name", ["", "a/b", "x" * 300, "a b", ".."]),
        *st.flag("--run-dir", ["", "a\nb"]),
        st.argv_case((*head, "kill", "--name", "a/b"), ("--name",), "kill --name a/b"),
        *co.flag("--dest", ["afile", ""]),
        sy.argv_case((*head, "sync", "missing", "--dest", "remote"), ("missing",),
                     "sync of a missing path"),
        *sy.flag("--dest", [""]),
        *host_list_cases(s, "ip_list", "--hosts"),
    ]



def measure_cases() -> list[Case]:
    """`scripts/measure.py`: every bad flag is refused before any host is contacted."""
    files = {"ip_list": HOSTS, "kh": b"", "key": b"k", "dir": Folder()}
    s = Scenario("measure", ("--hosts", "ip_list", "--known-hosts", "kh", "--model",
                             "gpt-tiny", "--out", "c.json", "--timeout", "5"), files)
    return [
        *s.flag("--timeout", POSITIVE), *s.flag("--seconds", POSITIVE),
        *s.flag("--connect-timeout", POSITIVE), *s.flag("--bench-seconds", POSITIVE),
        *s.flag("--port", [*BAD_PORT, "0"]), *s.flag("--micro-batch-size", BAD_POSITIVE_COUNT),
        *s.flag("--model", ["gpt-huge", ""]), *s.flag("--out", ["dir"]),
        *s.flag("--key", ["missing", "dir"]), *s.flag("--known-hosts", ["missing", "dir"]),
        *s.flag("--remote-python", ["", "a\nb"]),
        *host_list_cases(s, "ip_list", "--hosts"),
    ]

def generate_tc_cases() -> list[Case]:
    """`scripts/generate_heterogeneous_tc.py` (prints; nothing runs)."""
    files = plan_files({"ip_list": HOSTS})
    s = Scenario("generate_tc", ("--cluster", "c.json", "--hosts", "ip_list", "--iface", "eth0",
                                 "--link-gbps", "10", "--host-index", "1"), files)
    return [
        *s.flag("--host-index", [*BAD_COUNT, "4", "9" * 30]),
        *s.flag("--num-hosts", [*BAD_POSITIVE_COUNT, "3"], ("--num-hosts", "--hosts")),
        *s.flag("--iface", ["", "a/b", "x" * 16]), *s.flag("--link-gbps", [*POSITIVE, "0.0001"]),
        *s.flag("--group-by", ["x"]),
        *s.whole_file("c.json", "--cluster"), *host_list_cases(s, "ip_list", "--hosts"),
    ]


def coordinator_cases() -> list[Case]:
    """`scripts/coordinator.py`."""
    s = Scenario("coordinator", ("--listen", "127.0.0.1:0", "--plan", "p.json",
                                 "--start-timeout-s", "5"), plan_files())
    return [*s.flag("--listen", ["127.0.0.1", "127.0.0.1:70000", ":5", "a..b:5",
                                 "127.0.0.1:-1", "127.0.0.1:" + "9" * 30, ""]),
            *s.flag("--start-timeout-s", [*POSITIVE, "1e300"]),
            *s.whole_file("p.json", "--plan")]


def delay_line_cases() -> list[Case]:
    """`scripts/delay_line.py`."""
    s = Scenario("delay_line", ("--delays", '{"10.0.0.2": 20}', "--queue", "4213", "--tag",
                                "fz"), {})
    bad = ["", "x", "[]", '{"x": 1}', '{"10.0.0.2": -1}', '{"10.0.0.2": NaN}',
           '{"10.0.0.2": 1e400}', '{"10.0.0.2": ' + "9" * 400 + "}", '{"10.0.0.2": "1"}',
           '{"10.0.0.2": true}', '{"10.0.0.2": 60001}', "[" * 100_000,
           '{"10.0.0.2": ' + "1" * 5000 + "}", '{"10.0.0.2": {"a": 1}}',
           '{"999.0.0.1": 1}']
    return [*s.flag("--delays", bad), *s.flag("--queue", BAD_PORT[:1] + ["65536", "x", "9" * 30]),
            *s.flag("--tag", ["", "a\nb", "x" * 300])]


def rendezvous_cases() -> list[Case]:
    """`udp_hole_punching_test/rendezvous_server.py`."""
    s = Scenario("rendezvous_server", ("--bind", "127.0.0.1:47811", "--ttl-s", "60",
                                       "--rate-per-s", "50", "--relay-mbit-s", "0", "--token",
                                       "t"), {})
    return [
        *s.flag("--bind", ["127.0.0.1", "127.0.0.1:0", ":3478", "127.0.0.1:70000",
                           "127.0.0.1:65535", "a..b:3478", "127.0.0.1:x",
                           "127.0.0.1:" + "9" * 30, "no-such-host.invalid:3478"]),
        *s.flag("--ttl-s", POSITIVE), *s.flag("--rate-per-s", POSITIVE),
        *s.flag("--relay-mbit-s", NON_NEGATIVE), *s.flag("--token", ["", "x" * 5000]),
    ]


def peer_cases() -> list[Case]:
    """`udp_hole_punching_test/peer.py`."""
    files = {"dir": Folder(), "afile": b"x"}
    s = Scenario("peer", ("--server", "127.0.0.1:47812", "--session", "s1", "--token", "t",
                          "--local-port", "0", "--private-ip", "127.0.0.1", "--no-wireguard",
                          "--result-json", "r.json"), files)
    return [
        *s.flag("--server", ["x", "127.0.0.1:0", "127.0.0.1:70000", "a..b:3478", ":3478",
                             "no-such-host.invalid:3478"]),
        *s.flag("--session", ["", "x" * 5000, "a\nb"]), *s.flag("--token", ["", "x" * 5000]),
        *s.flag("--local-port", BAD_PORT),
        *s.flag("--private-ip", ["not-an-ip", "999.1.1.1", "", "::1"]),
        *s.flag("--register-timeout-s", [*POSITIVE, "1e300"]),
        *s.flag("--punch-timeout-s", [*POSITIVE, "1e300"]),
        *s.flag("--low-ttl", ["-1", "256", "x"]), *s.flag("--hold-s", NON_NEGATIVE),
        *s.flag("--result-json", ["dir", "afile/r.json"]),
    ]


def send_recv_cases() -> list[Case]:
    """`udp_hole_punching_test/send_recv_test.py`."""
    s = Scenario("send_recv_test", ("--dist-url", "tcp://127.0.0.1:47813", "--world-size", "2",
                                    "--rank", "0", "--size-mb", "1", "--iters", "2", "--warmup",
                                    "1", "--timeout-s", "5"), {})
    return [
        *s.flag("--dist-url", ["http://x:1", "tcp://", "tcp://127.0.0.1", "tcp://127.0.0.1:0",
                               "tcp://127.0.0.1:70000", "tcp://a..b:1"]),
        *s.flag("--world-size", ["3", "0", "x"]), *s.flag("--rank", ["2", "-1"]),
        *s.flag("--backend", ["mpi"]), *s.flag("--size-mb", [*POSITIVE, "1e12"]),
        *s.flag("--iters", [*BAD_POSITIVE_COUNT, "9" * 12]),
        *s.flag("--warmup", [*BAD_COUNT, "9" * 12]), *s.flag("--seed", ["-1", "9" * 30]),
        *s.flag("--timeout-s", [*POSITIVE, "1e300"]),
    ]


GENERATORS = (scheduler_cases, scheduler_plan_field_cases, scheduler_cluster_field_cases,
              dist_runner_cases, dist_runner_cluster_cases, launch_local_cases,
              local_cluster_cases, tc_cases, cluster_ssh_cases, measure_cases, generate_tc_cases,
              coordinator_cases, delay_line_cases, rendezvous_cases, peer_cases, send_recv_cases)
"""Every systematic case generator."""
