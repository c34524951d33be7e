"""Tiny random Qwen3 / Qwen3-MoE checkpoints written by transformers (config + safetensors).

No hub and no tokenizer: tests feed token ids and read token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TINY_DENSE", "TINY_MOE", "make_tiny_checkpoint", "load_canonical"]

#: Small enough for seconds-long CPU tests, shaped so that every layout rule is exercised:
#: GQA with P = 4 query heads per group, qk-norm, vocab not a multiple of 64 (vLLM pads it).
TINY_DENSE: dict[str, Any] = dict(
    architectures=["Qwen3ForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,  # the vLLM CPU attention backend supports head_dim >= 32
    vocab_size=1000,
    max_position_embeddings=512,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

TINY_MOE: dict[str, Any] = dict(
    TINY_DENSE,
    architectures=["Qwen3MoeForCausalLM"],
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)


def make_tiny_checkpoint(path: str | Path, overrides: dict[str, Any] | None = None, *, moe: bool = False,
                         dtype: str = "float32", seed: int = 0) -> Path:
    """Write a random-weight HF checkpoint to ``path`` and return it.

    Norm weights are randomised too (HF initialises them to ones, which would hide a
    norm mapped to the wrong tensor).
    """
    import torch
    import transformers

    cfg_kwargs = dict(TINY_MOE if moe else TINY_DENSE)
    cfg_kwargs.update(overrides or {})
    arch = cfg_kwargs["architectures"][0]
    config_cls = transformers.Qwen3MoeConfig if arch == "Qwen3MoeForCausalLM" else transformers.Qwen3Config
    config = config_cls(**{k: v for k, v in cfg_kwargs.items() if k != "architectures"})
    config.architectures = [arch]
    torch.manual_seed(seed)
    model_cls = getattr(transformers, arch)
    model = model_cls(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


def load_canonical(path: str | Path) -> dict[str, "torch.Tensor"]:  # noqa: F821
    """All tensors of a safetensors checkpoint directory, by HF name."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors
