"""The canonical tensors of an HF config as transformers itself writes them, built on the meta
device: the oracle the family tables (``layout.families``) are checked against.

``checkpoint_tensors(cfg)`` builds the architecture's own model class under
``torch.device("meta")`` (no memory, no weights), takes its state dict, drops tied weights and
reverts transformers' load-time conversions (its ``revert_weight_conversion``, what
``save_pretrained`` does: fused MoE experts back to per-expert names, ...), so the names and
shapes are those of a checkpoint on disk. The planner never calls this: plans run on the
tables alone (``layout`` imports no torch); tests compare the two for every family's tiny and
full-size config (``tests/test_families.py``).
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["checkpoint_tensors"]


def checkpoint_tensors(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape of the model ``cfg`` (an HF ``config.json``'s contents)
    describes, as transformers builds and saves it."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from ..layout.families import family_of_config

    cfg = dict(cfg)
    arch = (cfg.get("architectures") or [None])[0]
    fam = family_of_config(cfg)
    model_type = fam.model_types[0]  # transformers' type (Kimi-K2 names its own, kimi_k2: a DeepSeek-V3)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "quantization_config")}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    model_cls = getattr(transformers, arch or fam.architectures[0])
    with torch.device("meta"):
        model = model_cls(config)
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    state = revert_weight_conversion(model, state)
    return {name: tuple(t.shape) for name, t in state.items()}
