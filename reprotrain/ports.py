"""Free loopback ports for the servers the project starts: `make s3`, the benches, the tests."""

from __future__ import annotations

import contextlib
import socket


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports nothing listens on now, held open together while chosen (so
    none is handed out twice); closed again when this returns."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def free_port() -> int:
    return free_ports(1)[0]
