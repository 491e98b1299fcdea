"""FlagWaiter: whole waits on connections of their own, given up on `abandon` without any
timed-out store wait (c10d prints two warnings for each)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from modules.control.flag_wait import FlagWaiter


@pytest.fixture
def store():
    host = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30),
                         wait_for_workers=False)
    yield host


def _waiter(host) -> tuple[FlagWaiter, list]:
    opened = []

    def connect():
        opened.append(dist.TCPStore("127.0.0.1", host.port, is_master=False,
                                    wait_for_workers=False, timeout=timedelta(seconds=30)))
        return opened[-1]
    return FlagWaiter(connect), opened


def test_flags_set_later_end_the_wait_without_c10d_warnings(store, capfd):
    waiter, opened = _waiter(store)
    threading.Timer(1.2, lambda: (store.set("a", "1"), store.set("b", "1"))).start()
    t0 = time.monotonic()
    assert waiter.wait(["a", "b"], 10.0, abandon=lambda: False, poll_s=0.1) is True
    assert 1.0 < time.monotonic() - t0 < 5.0
    assert "waitForInput" not in capfd.readouterr().err  # the retried 0.5 s waits printed it
    assert waiter.wait(["a"], 10.0, abandon=lambda: False) is True
    assert len(opened) == 1  # the connection was reused


def test_abandon_returns_at_once_and_the_next_wait_opens_another_connection(store):
    waiter, opened = _waiter(store)
    moot = threading.Event()
    threading.Timer(0.5, moot.set).start()
    t0 = time.monotonic()
    assert waiter.wait(["never"], 20.0, abandon=moot.is_set, poll_s=0.1) is False
    assert time.monotonic() - t0 < 3.0
    store.set("c", "1")
    assert waiter.wait(["c"], 5.0, abandon=lambda: False) is True
    assert len(opened) == 2  # the abandoned helper still holds the first


def test_a_wait_that_times_out_raises_the_stores_error(store):
    waiter, _ = _waiter(store)
    with pytest.raises(RuntimeError):
        waiter.wait(["missing"], 0.5, abandon=lambda: False, poll_s=0.1)
