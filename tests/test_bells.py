"""Store waits a new generation cuts short (modules.control.bells): the waiter blocks on its
own inbox with the whole timeout, another connection fills it, and c10d prints nothing (a
retried 0.5 s wait printed two warnings per timeout)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from modules.control.bells import Bells, announce
from testkit.fault_harness import free_port


def _stores():
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    return host, client


def test_a_ring_cuts_a_wait_short_and_c10d_stays_quiet(capfd):
    host, client = _stores()
    bells, gen, got = Bells(), [0], []
    waiter = threading.Thread(target=lambda: got.append(
        bells.wait(client, "p", 0, (0, 1), 30, lambda: gen[0] > 0)))
    announce(client, "p", 0, (0, 1))  # rank 1 never comes
    waiter.start()
    time.sleep(1.5)  # three of the old 0.5 s timeouts
    assert waiter.is_alive() and not got
    t0 = time.monotonic()
    gen[0] = 1  # the heartbeat thread saw a new generation, then rings
    bells.ring(host)
    waiter.join(5)
    assert got == [False] and time.monotonic() - t0 < 1.0
    assert "waitForInput" not in capfd.readouterr().err


def test_every_flag_in_the_inbox_ends_the_wait_true():
    host, client = _stores()
    bells, got = Bells(), []
    waiter = threading.Thread(target=lambda: got.append(
        bells.wait(client, "p", 1, (0, 1), 30, lambda: False)))
    waiter.start()
    announce(host, "p", 0, (0, 1))
    announce(host, "p", 1, (0, 1))
    waiter.join(5)
    assert got == [True]
    assert bells._open == {}  # closed after the wait


def test_a_ring_before_the_wait_opened_is_seen_through_moot():
    _, client = _stores()
    t0 = time.monotonic()
    assert Bells().wait(client, "p", 0, (0, 1), 30, lambda: True) is False
    assert time.monotonic() - t0 < 1.0
