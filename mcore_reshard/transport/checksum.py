"""Exact checksums of raw bits, to prove a refit wrote what the source held.

Two algorithms, chosen by the tensor's device (both ends of a refit group share one):

- CPU: xXH3-64 (``xxhash``) of the bytes in logical (row-major) order, at memory speed (about
  8x the sums below on one core); a contiguous box is hashed in place, a strided one through
  one contiguous copy. Its row is ``[hash, nbytes]``.
- GPU (and ``checksum``): two integer sums computed with torch ops on the device, so nothing
  leaves it. Its row is ``[sum, weighted sum]``.

Floating-point sums are neither exact nor order-independent, so the bits are summed as
integers: the tensor's bytes viewed as words (int8/int16/int32), widened to int64 and summed
with two's-complement wraparound -- addition mod 2**64 is associative, so the result does not
depend on reduction order, thread count or device. A second sum weights word ``i`` by an odd
position-dependent factor, so two swapped words change it. Both ends iterate a box in the same
(row-major, box-relative) order, so a source view and a destination view of one box with
different strides give equal checksums.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import xxhash

__all__ = ["checksum", "checksums", "digest", "digest_at", "digest_bytes"]

_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
_MULT = 0x9E3779B1  # odd, so i -> i*_MULT + 1 never collapses two positions mod 2**64
_COLS = 1024  # words are summed as a (rows, _COLS) matrix, see _sums
_ROWS = {"cpu": 64, "cuda": 8192}  # rows widened per step: cache-sized on CPU, fewer launches on GPU


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as signed integer words, in its logical (row-major) order."""
    flat = t.contiguous().reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    word = _WORD[flat.element_size()]
    return flat if flat.dtype == word else flat.view(word)


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """(plain sum, position-weighted sum) of ``t``'s raw words, mod 2**64 as signed int64."""
    s = _sums(t)
    return int(s[0]), int(s[1])


def checksums(tensors: list[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """Checksums of several tensors as one ``(n, 2)`` int64 tensor (what goes on the wire):
    ``digest`` rows for CPU tensors, ``_sums`` rows for device tensors."""
    if not tensors:
        return torch.empty((0, 2), dtype=torch.int64, device=device)
    if all(t.device.type == "cpu" for t in tensors):
        return torch.tensor([digest(t) for t in tensors], dtype=torch.int64).to(device)
    return torch.stack([_sums(t) for t in tensors]).to(device)


def digest(t: torch.Tensor) -> tuple[int, int]:
    """``(xxh3_64 of t's bytes in row-major order as a signed int64, nbytes)`` of a CPU tensor.

    The bytes are hashed where they lie when ``t`` is contiguous (a packed wire slice, a whole
    parameter, a row range), else after one contiguous copy.
    """
    if t.dim() and t.is_contiguous() and not t.dtype.is_complex:  # the hot path: no copy, no reshape
        raw = t.view(torch.uint8)
    else:
        raw = t.contiguous().reshape(-1)
        if raw.dtype.is_complex:
            raw = torch.view_as_real(raw).reshape(-1)
        raw = raw.view(torch.uint8)
    n = raw.numel()
    return digest_bytes(raw.numpy()) if n else (0, 0)


def digest_at(at: tuple[int, int]) -> tuple[int, int]:
    """``digest`` of ``nbytes`` at ``address`` (``(address, nbytes)`` from ``packing.unpack``:
    a box it just wrote into a live tensor)."""
    addr, nbytes = at
    return digest_bytes((ctypes.c_char * nbytes).from_address(addr)) if nbytes else (0, 0)


def digest_bytes(buf: Any) -> tuple[int, int]:
    """``digest`` of raw bytes (a memoryview or a C-contiguous array): what both ends compute
    for a slice of one message without a tensor per box."""
    h = xxhash.xxh3_64_intdigest(buf)
    return (h - (1 << 64) if h >= 1 << 63 else h), memoryview(buf).nbytes


def _sums(t: torch.Tensor) -> torch.Tensor:
    """``[sum w_i, sum w_i * (i*_MULT + 1)]`` over the words ``w`` of ``t``, as int64[2].

    With ``i = r*_COLS + c`` the weighted sum splits into row sums ``R_r`` and column sums
    ``C_c``: ``_COLS*_MULT * sum r*R_r + sum (c*_MULT + 1)*C_c``, so no position tensor of the
    input's size is ever built; words are widened to int64 a cache-sized block at a time.
    """
    w = _words(t)
    n, dev = w.numel(), w.device
    m = n // _COLS
    rows_per_step = _ROWS.get(dev.type, _ROWS["cuda"])
    s1 = torch.zeros((), dtype=torch.int64, device=dev)
    s2 = torch.zeros((), dtype=torch.int64, device=dev)
    if m:
        body = w[: m * _COLS].view(m, _COLS)
        cols = torch.zeros(_COLS, dtype=torch.int64, device=dev)
        block = torch.empty((min(m, rows_per_step), _COLS), dtype=torch.int64, device=dev)
        for r0 in range(0, m, rows_per_step):
            part = body[r0 : r0 + rows_per_step]
            x = block[: part.shape[0]]
            x.copy_(part)
            rows = x.sum(1)
            r = torch.arange(r0, r0 + part.shape[0], dtype=torch.int64, device=dev)
            s1 += rows.sum()
            s2 += (r * rows).sum() * (_COLS * _MULT)
            cols += x.sum(0)
        c = torch.arange(_COLS, dtype=torch.int64, device=dev)
        s2 += ((c * _MULT + 1) * cols).sum()
    if n > m * _COLS:
        tail = w[m * _COLS :].to(torch.int64)
        pos = torch.arange(m * _COLS, n, dtype=torch.int64, device=dev)
        s1 += tail.sum()
        s2 += (tail * (pos * _MULT + 1)).sum()
    return torch.stack([s1, s2])
