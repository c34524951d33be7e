"""Dense GQA families: Llama (``LlamaForCausalLM``), Qwen2 (qkv bias) and Qwen3 (qk-norm).

One table serves all three: a layer is GQA attention then a SwiGLU MLP; what differs is read
from the config (``qkv_bias``, ``qk_norm``) and selects rows by their ``when``.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..family import Block, Family
from .common import dense_mlp, embedding, final, gqa_attention

__all__ = ["LLAMA", "QWEN2", "QWEN3", "TINY_QWEN3", "DENSE_BLOCKS"]

DENSE_BLOCKS = {"attention": Block(gqa_attention()), "mlp": Block(dense_mlp())}

#: Small enough for seconds-long CPU tests, shaped so that every layout rule is exercised:
#: GQA with P = 4 query heads per group, qk-norm, vocab not a multiple of 64 (vLLM pads it).
TINY_QWEN3: dict[str, Any] = dict(
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


def _dense_layers(spec: Any, layer: int) -> tuple[str, ...]:
    return ("attention", "mlp")


def _read(qkv_bias: bool | None, qk_norm: bool):
    def read(cfg: Mapping[str, Any]) -> dict[str, Any]:
        return dict(qkv_bias=bool(cfg.get("attention_bias", False)) if qkv_bias is None else qkv_bias, qk_norm=qk_norm)
    return read


def _dense(name: str, title: str, arch: str, read, tiny: Mapping[str, Any]) -> Family:
    return Family(name=name, title=title, architectures=(arch,), model_types=(name,), read=read, blocks=DENSE_BLOCKS,
                  layers=_dense_layers, pre=embedding(), post=final(), tiny=tiny)


LLAMA = _dense("llama", "Llama", "LlamaForCausalLM", _read(None, False),
               dict(TINY_QWEN3, architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False))
# Qwen2's config has no head_dim (it is hidden / heads): 128 / 4 keeps it at 32.
QWEN2 = _dense("qwen2", "Qwen2", "Qwen2ForCausalLM", _read(True, False),
               dict(TINY_QWEN3, architectures=["Qwen2ForCausalLM"], hidden_size=128, num_attention_heads=4))
QWEN3 = _dense("qwen3", "Qwen3", "Qwen3ForCausalLM", _read(None, True), TINY_QWEN3)
