"""The server side of a torch.distributed ``TCPStore``, listening only where it is told.

torch's ``TCPStore(host, port, is_master=True)`` uses ``host`` only for its
own client: its server listens on every interface (``[::]:port``), so a
store meant for ``127.0.0.1`` could be reached from any machine that reaches
this one. :func:`listening_store` binds the socket itself and hands it to
torch (``master_listen_fd``, which both of torch's server backends accept).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def listening_store(host: str, port: int, timeout: timedelta, world_size: int | None = None,
                    wait_for_workers: bool = False) -> dist.TCPStore:
    """The master of a TCP store whose server listens at ``host:port`` and
    nowhere else (port 0 picks a free one: read it from ``.port``). A
    wildcard ``host`` (``0.0.0.0``, ``::``) listens on every interface, as asked.
    ``world_size`` and ``wait_for_workers`` are ``TCPStore``'s."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family)
    bound_port = sock.getsockname()[1]
    # the store owns the descriptor from here and closes it when it is dropped
    return dist.TCPStore(host, bound_port, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=wait_for_workers, master_listen_fd=sock.detach())
