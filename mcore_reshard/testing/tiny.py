"""Kept for test code: the tiny checkpoints live in :mod:`mcore_reshard.checkpoint`."""

from ..checkpoint import TINY_DENSE, TINY_FAMILIES, TINY_MOE, load_canonical, make_tiny_checkpoint, tiny_config

__all__ = ["TINY_DENSE", "TINY_MOE", "TINY_FAMILIES", "tiny_config", "make_tiny_checkpoint", "load_canonical"]
