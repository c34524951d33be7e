"""Shared-memory segments for same-device transfers (a colocated trainer and vLLM worker).

A sender whose plan slice names same-device peers packs its buckets into a ``/dev/shm`` file
mapped ``MAP_SHARED`` instead of a private buffer; the receiver maps the same file and unpacks
straight from it, so those bytes never touch a socket (only a tiny ready/consumed flag travels
over the refit group). The file is the sender's wire buffer, so ``refit.buffer_bytes`` caps it
like any other.

Names cannot be guessed: an HMAC under the refit group's key (derived from the job's secret)
of the sender's group rank and a random nonce that only travels inside the group. Files are
created exclusively with mode 0600 and a receiver only maps a regular file owned by its own
user. The sender removes the file when its refit ends, failed or not.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass

import torch

__all__ = ["SHM_DIR", "ShmSegment", "segment_path", "new_nonce"]

#: Where segments live: tmpfs when the machine has it.
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "mcore_reshard-"


def new_nonce() -> int:
    """A fresh per-refit nonce (fits an int64 flag)."""
    return secrets.randbits(62)


def segment_path(key: bytes, group_rank: int, nonce: int, directory: str = SHM_DIR) -> str:
    """The segment of sender ``group_rank`` for the refit with ``nonce``: unguessable without ``key``."""
    tag = hmac.new(key, f"shm|{group_rank}|{nonce}".encode(), hashlib.sha256).hexdigest()[:32]
    return os.path.join(directory, PREFIX + tag)


@dataclass(frozen=True)
class ShmSegment:
    """A mapped file: ``data`` is its bytes as a uint8 tensor (kept alive with the map)."""

    path: str
    data: torch.Tensor
    owner: bool  # created here: this side removes it

    @classmethod
    def create(cls, path: str, nbytes: int) -> "ShmSegment":
        """Create ``path`` (exclusively, mode 0600) of ``nbytes`` and map it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        return cls(path, torch.frombuffer(mm, dtype=torch.uint8)[:nbytes], owner=True)

    @classmethod
    def attach(cls, path: str) -> "ShmSegment":
        """Map an existing segment (never creates one): a regular file of this user, 0600."""
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise PermissionError(f"shared-memory segment {path} is not a private file of this user")
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, torch.frombuffer(mm, dtype=torch.uint8), owner=False)

    def elements(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole segment as a 1-D tensor of ``dtype`` (page-aligned, so any dtype fits)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.data[: self.data.numel() // itemsize * itemsize].view(dtype)

    def unlink(self) -> None:
        """Remove the file (mappings stay valid until dropped); missing is fine."""
        _unlink(self.path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
