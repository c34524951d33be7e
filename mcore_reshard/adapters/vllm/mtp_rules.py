"""vLLM's MTP draft (``model_executor/models/deepseek_mtp.py``: ``DeepSeekMTP``) as boxes of
the canonical draft tensors (``layout.mtp``), as the spec-decode worker builds it beside the
target on every TP rank.

``model.layers.{L+i}.enorm`` / ``hnorm`` / ``shared_head.norm`` are replicated, ``eh_proj`` is a
plain ``nn.Linear(2H, H)`` (replicated, loaded whole), and ``mtp_block`` is a
``DeepseekV2DecoderLayer`` sharded exactly as a target layer (``rules._Builder.layer_params``
under the ``mtp_block.`` prefix). The draft's ``embed_tokens`` and ``shared_head.head`` are the
target's own tensors (``llm_base_proposer._maybe_share_embeddings`` / ``_maybe_share_lm_head``,
unconditionally for MTP with PP 1): not described again, so they move once.
"""

from __future__ import annotations

from ...layout import LayoutError, LocalParam, ModelSpec, Piece
from ...layout.mtp import draft_layers, mtp_spec
from .parallel import VllmParallel
from .rules import _Builder, _full

__all__ = ["vllm_draft_rank_params"]


def _whole(rank: int, name: str, canonical: str, shape: tuple[int, ...], dtype: str) -> LocalParam:
    """A replicated parameter that is the whole canonical tensor."""
    return LocalParam(rank, name, shape, dtype, (Piece(rank, name, canonical, *_full(shape)),))


def vllm_draft_rank_params(spec: ModelSpec, par: VllmParallel, rank: int) -> list[LocalParam]:
    """The MTP draft's parameters on one vLLM worker."""
    s = mtp_spec(spec)
    if par.pp != 1:
        raise LayoutError(f"vllm.pp={par.pp}: an MTP draft beside a pipelined target keeps its own embedding copy "
                          f"in vLLM; described for pp=1 only")
    if par.quantization is not None:
        raise LayoutError(f"vllm.quantization={par.quantization} with an MTP draft: not described yet")
    b = _Builder(s, par)
    H, dt = s.hidden, s.dtype
    out: list[LocalParam] = []
    for layer in draft_layers(s):
        p = f"model.layers.{layer}."
        out += [_whole(rank, p + "enorm.weight", p + "enorm.weight", (H,), dt),
                _whole(rank, p + "hnorm.weight", p + "hnorm.weight", (H,), dt),
                _whole(rank, p + "eh_proj.weight", p + "eh_proj.weight", (H, 2 * H), dt),
                _whole(rank, p + "shared_head.norm.weight", p + "shared_head.norm.weight", (H,), dt)]
        b.layer_params(out, rank, layer, local=p + "mtp_block.")
    return out
