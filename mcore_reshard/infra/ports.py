"""Rendezvous ports for the process groups this library creates (no torch import)."""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "bound_store"]

#: Where ``free_port`` looks first: below the kernel's ephemeral range, which every outgoing
#: connection draws from. A port handed out from that range (``bind(0)``) can be taken by any
#: process's next connection before the store binds it ("Address already in use").
_LOW = 20000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now for a rendezvous store: a random one below the ephemeral range that
    binds (so no outgoing connection takes it before the store does), else one the OS picks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    top = _ephemeral_low()
    for port in random.sample(range(_LOW, top), min(64, max(0, top - _LOW))):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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
