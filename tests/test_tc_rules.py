"""tc rule generation from cluster files (pure; no root needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_entry

from formats.cluster import Cluster, Device, save_cluster
from formats.errors import UserError
from scripts.netemu.hostlist import load_host_list, parse_host_line
from scripts.netemu.shaping import LiveHost, compare, line_delays_of, sender_line_delays
from scripts.netemu.tcrules import (
    MAX_CLASSES,
    MAX_FILTERS,
    apply_commands,
    build_host_rules,
    format_rate,
    group_devices,
    host_links,
    receiver_delays,
    render,
)


def _cluster(lat: list[list[float]], bw: list[list[float]], regions: list[str] | None = None
             ) -> Cluster:
    n = len(lat)
    regions = regions or [f"r{i}" for i in range(n)]
    devs = [Device(i, f"d{i}", regions[i], f"10.9.0.{i + 1}", "T4-16GB", 65.0, 16.0)
            for i in range(n)]
    bw_m = np.array(bw, dtype=float)
    np.fill_diagonal(bw_m, np.inf)
    return Cluster("t", devs, np.array(lat, dtype=float), bw_m)


def _three() -> Cluster:
    # host 0 sends to 1 and 2 at the same (rate, delay): one class; to host 0 from 2 differs.
    lat = [[0, 10, 10], [10, 0, 30], [20, 30, 0]]
    bw = [[0, 0.1, 0.1], [0.1, 0, 0.05], [0.2, 0.05, 0]]
    return _cluster(lat, bw)


def test_one_class_per_distinct_rate_delay_set() -> None:
    c = _three()
    rules = build_host_rules(c, group_devices(c), ["10.9.0.1", "10.9.0.2", "10.9.0.3"])
    assert [(k.rate_kbit, k.delay_ms, k.dest_hosts) for k in rules[0].classes] == [
        (100_000, 10.0, [1, 2])]
    assert [(k.rate_kbit, k.delay_ms, k.dest_hosts) for k in rules[2].classes] == [
        (200_000, 20.0, [0]), (50_000, 30.0, [1])]
    assert [k.classid for k in rules[2].classes] == ["1:10", "1:11"]


def test_commands_exact_text() -> None:
    c = _three()
    rules = build_host_rules(c, group_devices(c), ["10.9.0.1", "10.9.0.2", "10.9.0.3"],
                             iface="veth7", link_gbps=1.0)
    text = [" ".join(x) for x in apply_commands(rules[2])]
    assert text == [
        "tc qdisc add dev veth7 root handle 1: htb default 0",
        "tc class add dev veth7 parent 1: classid 1:1 htb rate 1000mbit ceil 1000mbit "
        "quantum 200000",
        "tc class add dev veth7 parent 1:1 classid 1:10 htb rate 200mbit ceil 200mbit "
        "quantum 200000",
        "tc qdisc add dev veth7 parent 1:10 handle 10: netem delay 20ms limit 1000",
        "tc filter add dev veth7 parent 1: protocol ip prio 1 u32 match ip dst 10.9.0.1/32 "
        "flowid 1:10",
        "tc class add dev veth7 parent 1:1 classid 1:11 htb rate 50mbit ceil 50mbit "
        "quantum 200000",
        "tc qdisc add dev veth7 parent 1:11 handle 11: netem delay 30ms limit 1000",
        "tc filter add dev veth7 parent 1: protocol ip prio 1 u32 match ip dst 10.9.0.2/32 "
        "flowid 1:11",
    ]
    no_netem = [" ".join(x) for x in apply_commands(rules[2], netem=False)]
    assert not any("netem" in x for x in no_netem) and len(no_netem) == len(text)
    assert no_netem[3] == "tc qdisc add dev veth7 parent 1:10 handle 10: pfifo limit 1334"


def test_rates_exact_in_mbit_or_kbit() -> None:
    assert format_rate(1_120_000) == "1120mbit"
    assert format_rate(523_000) == "523mbit"
    assert format_rate(1_500) == "1500kbit" and format_rate(2_000) == "2mbit"
    assert format_rate(1) == "1kbit"
    c = _cluster([[0, 1], [1, 0]], [[0, 0.0005235], [0.0005235, 0]])
    rules = build_host_rules(c, group_devices(c), ["10.9.0.1", "10.9.0.2"])
    assert "rate 524kbit" in " ".join(apply_commands(rules[0])[2])


def test_rate_above_link_capacity_is_error() -> None:
    c = _three()
    with pytest.raises(UserError, match=r"host 2 .* -> host 0 .*rate 200mbit is above the link "
                                        r"capacity 150mbit"):
        build_host_rules(c, group_devices(c), ["10.9.0.1", "10.9.0.2", "10.9.0.3"],
                         link_gbps=0.15)


def test_too_many_classes_is_error() -> None:
    lat = [[0, 1, 2, 3], [1, 0, 1, 1], [2, 1, 0, 1], [3, 1, 1, 0]]
    c = _cluster(lat, [[0.1] * 4] * 4)
    with pytest.raises(UserError, match="more than 2 distinct"):
        build_host_rules(c, group_devices(c), [f"10.9.0.{i}" for i in range(1, 5)],
                         max_classes=2)
    assert MAX_CLASSES == 0xFFFE - 0x10 + 1


def test_too_many_destination_hosts_is_error() -> None:
    c = _three()  # 3 hosts: 2 u32 filters per host
    with pytest.raises(UserError, match="3 hosts: .* at most 1 per host"):
        build_host_rules(c, group_devices(c), ["10.9.0.1", "10.9.0.2", "10.9.0.3"],
                         max_filters=1)
    assert MAX_FILTERS == 4095


@pytest.mark.parametrize("gbps", [float("nan"), float("inf"), 0.0, -1.0])
def test_link_gbps_must_be_finite_and_positive(gbps: float) -> None:
    c = _three()
    with pytest.raises(UserError, match="--link-gbps: "):
        build_host_rules(c, group_devices(c), ["10.9.0.1", "10.9.0.2", "10.9.0.3"],
                         link_gbps=gbps)


def test_no_netem_render_names_the_delay_line_command() -> None:
    c = _three()
    addrs = ["10.9.0.1", "10.9.0.2", "10.9.0.3"]
    rules = build_host_rules(c, group_devices(c), addrs)
    d = receiver_delays(c, group_devices(c), addrs)
    text = render(rules[0], netem=False, line_delays=d[0])
    assert ("# delay NOT APPLIED by these commands (no netem): run on this host (root): "
            "python3 scripts/delay_line.py --delays '{\"10.9.0.2\": 10.0, \"10.9.0.3\": 20.0}'"
            ) in text.splitlines()
    assert "NOT APPLIED" not in render(rules[0], netem=True, line_delays=d[0])
    # no delay into host 0 at all: still says the commands apply no delay
    c0 = _cluster([[0, 10], [0, 0]], [[0, 0.1], [0.1, 0]])
    r0 = build_host_rules(c0, group_devices(c0), addrs[:2])
    assert "delay NOT APPLIED by these commands (no netem): nothing to hold on this host" in (
        render(r0[0], netem=False, line_delays={}))


def test_delay_line_readback_per_destination() -> None:
    """show: the delay comes from the running delay lines' command lines, per destination."""
    argv = "python3 delay_line.py --delays {\"10.9.0.1\": 10.0, \"10.9.0.2\": 30.0}"
    assert line_delays_of(argv) == {"10.9.0.1": 10.0, "10.9.0.2": 30.0}
    wrapped = ("sh -c export SCATTERED_HOST_INDEX=2; python3 .scattered/netemu/delay_line.py "
               "--delays '{\"10.9.0.1\": 10.0}'")
    assert line_delays_of(wrapped) == {"10.9.0.1": 10.0}
    assert line_delays_of("sleep 100 --delays {}") is None and line_delays_of("") is None
    c = _three()
    addrs = ["10.9.0.1", "10.9.0.2", "10.9.0.3"]
    rules = build_host_rules(c, group_devices(c), addrs)
    live = LiveHost({0x10: 100e6}, {}, {"10.9.0.2": 0x10, "10.9.0.3": 0x10}, True)
    right = receiver_delays(c, group_devices(c), addrs)
    rows, ok = compare(rules[0], live, sender_line_delays(addrs, list(right), 0))
    assert ok and rows[0][5] == "10ms (delay-line)", rows
    # host 2's line holds host 0's packets 25 ms instead of 10: the class (two destinations,
    # the first one right) shows the wrong one
    wrong = [None, right[1], {**right[2], "10.9.0.1": 25.0}]
    rows, ok = compare(rules[0], live, sender_line_delays(addrs, wrong, 0))
    assert not ok and rows[0][5] == "25ms (delay-line)" and rows[0][6] == "MISMATCH", rows
    rows, ok = compare(rules[0], live, sender_line_delays(addrs, [None, None, None], 0))
    assert not ok and rows[0][5] == "NOT APPLIED"


def test_grouping_modes_and_shared_links() -> None:
    lat = np.full((6, 6), 5.0)
    bw = np.full((6, 6), 1.0)
    lat[0, 3] = 40.0  # the slowest device pair decides the host link
    bw[1, 4] = 0.2
    np.fill_diagonal(lat, 0)
    c = _cluster(lat.tolist(), bw.tolist(), regions=["a", "b", "a", "c", "b", "a"])
    assert group_devices(c, "modulo", 2) == [(0, 2, 4), (1, 3, 5)]
    assert group_devices(c, "region") == [(0, 2, 5), (1, 4), (3,)]
    assert group_devices(c, "region", 2) == [(0, 2, 3, 5), (1, 4)]
    g = group_devices(c, "modulo", 2)
    hl, hb = host_links(c, g)
    assert hl[0, 1] == 40.0 and hb[1, 0] == 0.2 and hb[0, 1] == 1.0
    with pytest.raises(UserError, match="distinct device.host"):
        group_devices(c, "host", 3)
    with pytest.raises(UserError, match="--hosts: must be 1..6"):
        group_devices(c, "modulo", 7)


def test_receiver_delays_are_per_source() -> None:
    c = _three()
    d = receiver_delays(c, group_devices(c), ["a0", "a1", "a2"])
    # receiver 0 gets host 1's packets after lat[1][0]=10, host 2's after lat[2][0]=20.
    assert d[0] == {"a1": 10.0, "a2": 20.0}
    assert d[2] == {"a0": 10.0, "a1": 30.0}


def test_host_list_parsing(tmp_path) -> None:
    f = tmp_path / "ip_list"
    f.write_text("# fleet\nroot@10.0.0.1\n\nubuntu@10.0.0.2:2222  # gpu box\nme@[::1]:22\n")
    hosts = load_host_list(f)
    assert [h.label for h in hosts] == ["root@10.0.0.1:22", "ubuntu@10.0.0.2:2222",
                                        "me@::1:22"]
    assert hosts[1].known_hosts_name() == "[10.0.0.2]:2222"
    with pytest.raises(UserError, match="user is required"):
        parse_host_line("10.0.0.1", "x:1")
    with pytest.raises(UserError, match="port must be 1..65535"):
        parse_host_line("a@h:99999", "x:1")


def test_cli_prints_rules_and_errors_cleanly(tmp_path) -> None:
    path = tmp_path / "c.json"
    save_cluster(_three(), path)
    ok = run_entry("scripts/generate_heterogeneous_tc.py", "--cluster", str(path),
                   "--host-index", "2", "--iface", "ens5")
    assert ok.returncode == 0, ok.stderr
    assert "tc qdisc add dev ens5 root handle 1: htb default 0" in ok.stdout
    assert "u32 match ip dst 10.9.0.2/32 flowid 1:11" in ok.stdout
    assert "tc qdisc del dev ens5 root" in ok.stdout
    bad = run_entry("scripts/generate_heterogeneous_tc.py", "--cluster", str(path),
                    "--link-gbps", "0.1")
    assert bad.returncode == 2 and bad.stderr.startswith("error: host 2")
    assert "Traceback" not in bad.stderr
    nan = run_entry("scripts/generate_heterogeneous_tc.py", "--cluster", str(path),
                    "--link-gbps", "nan")
    assert nan.returncode == 2 and nan.stderr == "error: --link-gbps: nan Gbit/s is not a " \
        "finite rate\n", nan.stderr
    no_netem = run_entry("scripts/generate_heterogeneous_tc.py", "--cluster", str(path),
                         "--host-index", "2", "--no-netem")
    assert no_netem.returncode == 0 and "netem delay" not in no_netem.stdout
    assert "run on this host (root): python3 scripts/delay_line.py --delays '{\"10.9.0.1\": " \
        "10.0, \"10.9.0.2\": 30.0}'" in no_netem.stdout, no_netem.stdout
    obj = json.loads(path.read_text())
    obj["devices"][0]["host"] = "gpu-box-1"
    path.write_text(json.dumps(obj))
    named = run_entry("scripts/generate_heterogeneous_tc.py", "--cluster", str(path))
    assert named.returncode == 2 and "not an IPv4 address" in named.stderr
    iplist = tmp_path / "ip_list"
    iplist.write_text("root@192.0.2.1\nroot@192.0.2.2\n")
    two = run_entry("scripts/generate_heterogeneous_tc.py", "--cluster", str(path), "--hosts",
                    str(iplist))
    assert two.returncode == 0, two.stderr
    assert "# host 1 192.0.2.2 devices [1]" in two.stdout  # modulo: device 1 on host 1
