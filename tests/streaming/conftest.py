"""Fixtures shared by the streaming client tests."""

from __future__ import annotations

import os
import socket
import time

import pytest

from simulator.serve import start_in_thread
from streaming import h1


@pytest.fixture(scope="module")
def fast():
    """The simulator's fast profile in a background thread, one per test module."""
    handle = start_in_thread("fast")
    yield handle
    handle.stop()


@pytest.fixture
def stamping_live():
    """Hold the kernel's packet stamping on for the test. Linux turns it on for the whole system
    when the first socket asks (SO_TIMESTAMPNS), in deferred work: packets that arrive before
    that work runs carry no stamp, and the connection falls back to its clock read. A loopback
    pair asks first and reads until a stamp comes back; it stays open so stamping stays on."""
    listener = socket.create_server(("127.0.0.1", 0))
    receiver = socket.create_connection(listener.getsockname())
    sender, _ = listener.accept()
    listener.close()
    receiver.setsockopt(socket.SOL_SOCKET, h1._SO_TIMESTAMPNS, 1)
    receiver.settimeout(1)
    # Bounded by time, not by reads: on a loaded 2-core host the deferred work can wait longer
    # for a CPU than 500 loopback round trips take (a CI run caught that).
    deadline = time.monotonic() + 10
    try:
        while True:
            sender.sendall(b"x")
            _, ancdata, _, _ = receiver.recvmsg(16, h1._CMSG_SPACE)
            if any(kind == h1._SO_TIMESTAMPNS for _, kind, _ in ancdata):
                break
            if time.monotonic() > deadline:
                pytest.fail("no kernel receive stamp in 10 s of loopback reads")
            os.sched_yield()  # the kernel's deferred work needs a CPU too
        yield
    finally:
        sender.close()
        receiver.close()
