"""The canary a refit carries (``refit.canary``): fixed token sequences, the policy's most likely
token after each of their prefixes with the trainers' log-prob of it under the policy being
sent, and the bound an engine's own log-probs must meet.

Each engine's workers run the sequences through the engine's model on the new weights before
they serve (``adapters/vllm/canary.py``) and vote no past the bound, so a refit whose bytes
are right but whose engine computes something else (a layout wrong the same way on both
sides, state derived from the weights left stale) fails like any failed refit: the old
weights are served, or the engine is gated. What it costs and what it catches:
``docs/canary.md``.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

from ..errors import ConfigError
from .protocol import Canary

__all__ = ["TOKEN_MULT_PROB_BOUND", "canary_sequences", "make_canary", "canary_precision", "canary_bound"]

#: Healthy token_mult_prob_error after a refit: fp32 computes the same model on both sides up
#: to kernel order (1.001); bf16 kernels differ between megatron and vLLM, and NeMo RL calls a
#: step healthy below 1.05.
#: An FP8 engine (block FP8, W8A16) is checked against the trainers' reference computed with
#: the weights' own FP8 round trip (``transport.quantize.as_sent``): the engine's kernel and
#: that round trip in bf16 still differ per weight, and a near-tie in MoE routing turns that
#: into a token's worth of error (a 40-refit soak of the tiny MoE: median 1.01, worst 1.10;
#: docs/canary.md), hence FP8's own bound.
TOKEN_MULT_PROB_BOUND = {"float32": 1.001, "bfloat16": 1.05, "float16": 1.05, "float8_e4m3fn": 1.2}

#: The canary's sequences are drawn once from this seed: every refit of every job checks the same ones.
CANARY_SEED = 0x6361_6E61


def canary_sequences(vocab: int, count: int, length: int) -> tuple[tuple[int, ...], ...]:
    """``count`` fixed sequences of ``length`` token ids below ``vocab`` (the same every time)."""
    rng = random.Random(CANARY_SEED)
    return tuple(tuple(rng.randrange(vocab) for _ in range(length)) for _ in range(count))


def canary_precision(engine_dtype: str, plan: Any) -> str:
    """The precision whose bound a refit's canary takes: the plan's FP8 where it quantizes for
    an FP8 engine (``TransferPlan.quantized``), else the engine's dtype."""
    return plan.dtype if plan is not None and plan.quantized else engine_dtype


def canary_bound(dtype: str, override: float = 0.0) -> float:
    """The bound for weights served in ``dtype``: ``override`` when set, else the precision's."""
    if override:
        return float(override)
    if dtype not in TOKEN_MULT_PROB_BOUND:
        raise ConfigError(f"refit.canary_bound: no default bound for dtype {dtype!r}; set one")
    return TOKEN_MULT_PROB_BOUND[dtype]


def make_canary(vocab: int, dtype: str, count: int, length: int, bound: float,
                top: Callable[[list[list[int]]], Sequence[tuple[Sequence[int], Sequence[float]]]] | None = None,
                draft: bool = False) -> Canary:
    """The canary of one refit: the fixed sequences, and after each prefix the token the policy
    being sent finds most likely and its log-prob there (``top(sequences)``: the trainers'
    ``top_logprobs``) -- the targets and the reference -- and the bound. Likely tokens, not the
    sequences' own: the precision's bound holds for the tokens a policy samples, not for its
    distribution's tail (``wire.protocol.Canary``).

    ``top=None`` (what the driver sends): a **deferred** canary -- the training ranks compute
    the targets and the reference inside the refit, after their last byte, while the engines
    still receive and stage (``Canary.deferred``), instead of before the first byte. ``draft``:
    the engines' MTP draft is checked too (deferred only)."""
    seqs = canary_sequences(vocab, count, length)
    deferred = Canary(seqs, (), canary_bound(dtype, bound), dtype, draft=draft)
    if top is None:
        return deferred
    if draft:
        raise ValueError("make_canary: a canary that checks the draft is deferred (the trainers' MTP head fills it in)")
    return deferred.completed(top([list(s) for s in seqs]))
