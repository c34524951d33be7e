"""Rendezvous ports for the process groups this library creates (no torch import)."""

from __future__ import annotations

import socket

__all__ = ["free_port", "bound_store"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS says is free now (bind to port 0) for a rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bound_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float):
    """A ``TCPStore`` whose master listens on ``host`` only, never a wildcard address: the
    socket is bound here and handed to the store (``master_listen_fd``), which then owns it."""
    from datetime import timedelta

    import torch.distributed as dist

    listener = None
    if is_master:
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(256)
    try:
        store = dist.TCPStore(host, port, world_size, is_master, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False,
                              master_listen_fd=listener.fileno() if listener is not None else None)
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    if listener is not None:
        listener.detach()  # the store's server owns (and closes) the fd now: never close it twice
    return store
