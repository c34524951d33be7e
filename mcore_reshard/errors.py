"""The library's errors: one for bad settings, one family for refits that fail.

``ConfigError`` is raised before anything starts (the CLI prints it as one ``error:`` line and
exits 2); every failure of a running refit is a ``RefitError``, whichever rank, side or
transport saw it first, so a caller catches one type.
"""

from __future__ import annotations

from .layout.descriptor import LayoutError

__all__ = [
    "ConfigError",
    "LayoutError",
    "RefitError",
    "RefitTimeout",
    "RefitAborted",
    "RefitFailed",
    "RefitIncomplete",
    "TrainerError",
    "EngineUnresponsive",
    "EngineDead",
]


class ConfigError(ValueError):
    """A setting is wrong (unknown key, impossible size, bad type); the message names it."""


class RefitError(RuntimeError):
    """A refit failed; the message names the rank, its peer and the bucket where known."""


class RefitTimeout(RefitError):
    """A wait ran past its timeout (a peer is slow, stuck or silent)."""


class RefitAborted(RefitError):
    """Another rank failed first and told this one to stop (the abort signal)."""


class RefitFailed(RefitError):
    """Raised by a driver: one line per failing rank of either side."""


class RefitIncomplete(RefitError):
    """A refit stopped after live weights were partly replaced: the engine must not serve."""


class EngineUnresponsive(RefitError):
    """An engine did not answer a call within its deadline (a worker stopped, hung or dead):
    no further call is sent to it until that one returns (``adapters.vllm.engine.engine_call``)."""


class EngineDead(RefitError):
    """An engine will never answer again (its core or a worker died): refused until replaced.
    Raised by a destination's adapter, which knows its engine's words for it."""


class TrainerError(RefitError):
    """A training rank failed or died; the message names the rank."""
