"""megatron-core's MTP block (``transformer/multi_token_prediction.py``) as boxes of the
canonical draft tensors (``layout.mtp``).

On the last pipeline stage (its last virtual chunk), MTP layer ``i`` of a ``GPTModel`` holds
``mtp.layers.{i}.enorm`` / ``hnorm`` (replicated), ``eh_proj`` (a ``ColumnParallelLinear`` of
``2H -> H``: output rows split over TP, input ``[embedding half; hidden half]`` in HF's order),
``final_layernorm`` (HF ``shared_head.norm``) and ``mtp_model_layer``: a decoder layer of the
last layer's spec, laid out exactly as a decoder layer (``rules._dense_layer`` /
``_expert_layer``) under that prefix. Its embedding and output head are the model's own
(``GPTModel.embedding`` / ``output_layer``): nothing of them is described here.
(``sharded_state_dict`` spells ``mtp_model_layer`` as ``transformer_layer``; these are
``named_parameters`` names.)
"""

from __future__ import annotations

from ...layout import LocalParam, ModelSpec
from ...layout.mtp import draft_layers, mtp_spec
from .rules import (MegatronParallel, _chunk_prefix, _col_parallel, _dense_layer, _expert_layer, _full, _stamp,
                    rank_coords)

__all__ = ["megatron_mtp_rank_params"]


def megatron_mtp_rank_params(spec: ModelSpec, par: MegatronParallel, rank: int) -> list[LocalParam]:
    """The MTP layers' parameters of one training rank (none off the last pipeline stage)."""
    s = mtp_spec(spec)
    c = rank_coords(par, rank)
    if c["pp"] != par.pp - 1:
        return []
    H, tp, tp_r = s.hidden, par.tp, c["tp"]
    chunk = _chunk_prefix(par, par.vpp - 1)
    tmpls = []
    for i, layer in enumerate(draft_layers(s)):
        p, hf = f"{chunk}mtp.layers.{i}.", f"model.layers.{layer}."
        tmpls += [_full(p + "enorm.weight", hf + "enorm.weight", (H,)),
                  _full(p + "hnorm.weight", hf + "hnorm.weight", (H,)),
                  _col_parallel(p + "eh_proj.weight", hf + "eh_proj.weight", H, 2 * H, tp, tp_r),
                  _full(p + "final_layernorm.weight", hf + "shared_head.norm.weight", (H,))]
        tmpls += _dense_layer(s, par, layer, p + "mtp_model_layer.", tp_r)
        if s.is_moe(layer):
            tmpls += _expert_layer(s, par, layer, p + "mtp_model_layer.", c["ep"], c["etp"])
    out: list[LocalParam] = []
    _stamp(rank, s.dtype, tmpls, out)
    return out
