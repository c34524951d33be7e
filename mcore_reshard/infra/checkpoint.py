"""HF checkpoints on disk: read one as canonical tensors, or write a tiny random one.

``load_canonical`` is how a refit job and the tests load weights by HF name. The tiny random
checkpoints (Qwen3, Qwen3-MoE, Llama-3, Qwen2 with qkv bias, DeepSeek-V3), written by transformers, are the
built-in models of the demo job and the tests: no hub and no tokenizer, token ids in and out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TINY_HYBRIDS", "TINY_DENSE", "TINY_MOE", "TINY_DEEPSEEK_V3", "TINY_DENSE_128", "TINY_MOE_128", "TINY_FAMILIES", "tiny_config", "make_tiny_checkpoint", "load_canonical"]

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

#: DeepSeek-V3 shaped: MLA with q_lora (set ``q_lora_rank=None`` for a plain q_proj), one dense
#: first layer, then MoE layers with a shared expert and a sigmoid router with
#: e_score_correction_bias. vLLM's CPU MLA kernel compiles only for kv_lora_rank 512 + rope 64;
#: one expert group (megatron and HF score groups differently).
TINY_DEEPSEEK_V3: dict[str, Any] = dict(
    architectures=["DeepseekV3ForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=512,
    qk_nope_head_dim=32,
    qk_rope_head_dim=64,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    n_group=1,
    topk_group=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=0,
    vocab_size=1000,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rope_scaling=None,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

#: FP8 rollout's tiny models: every linear a whole number of 128x128 blocks, as vLLM's CPU
#: block-FP8 kernels need (K-block 128; every merged shard but the last, and the MoE
#: intermediate per TP rank, multiples of 128): head_dim 128 and 256-wide MLPs, so every shard
#: is whole blocks at TP1 and TP2 (experts under TP included).
TINY_DENSE_128: dict[str, Any] = dict(
    TINY_DENSE,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
)
TINY_MOE_128: dict[str, Any] = dict(TINY_MOE, **{k: v for k, v in TINY_DENSE_128.items() if k != "architectures"},
                                    moe_intermediate_size=256)

#: Hybrid families (``layout.hybrid``). Nemotron-H: Mamba2 (8 heads of 16, 2 groups) + MLP +
#: attention, fp32-servable by the vLLM CPU engine (prompts < 64 tokens); ``nemotron_h_g1``
#: has one group, which vLLM replicates on every TP rank; ``nemotron_h_moe`` adds a MoE layer
#: (non-gated relu2 experts: vLLM's CPU FusedMoE refuses them, ``is_act_and_mul=False``).
#: Qwen3-Next: GDN (2 key heads, 4 value heads, dims 64: the CPU GDN kernel needs 64 or 128) +
#: gated attention + MoE with a shared expert, and one dense layer; served in bf16 only.
TINY_NEMOTRON_H: dict[str, Any] = dict(
    architectures=["NemotronHForCausalLM"], vocab_size=1000, hidden_size=64,
    layers_block_type=["mamba", "mlp", "attention", "mamba", "mlp"], num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, intermediate_size=128, ssm_state_size=16, mamba_num_heads=8,
    mamba_head_dim=16, n_groups=2, conv_kernel=4, use_conv_bias=True, max_position_embeddings=512,
    tie_word_embeddings=False, n_routed_experts=4, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    num_experts_per_tok=2, n_shared_experts=1)
TINY_QWEN3_NEXT: dict[str, Any] = dict(
    architectures=["Qwen3NextForCausalLM"], vocab_size=1000, hidden_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, intermediate_size=128,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
    decoder_sparse_step=1, mlp_only_layers=[3], max_position_embeddings=512, tie_word_embeddings=False,
    norm_topk_prob=True)
TINY_HYBRIDS: dict[str, dict[str, Any]] = {
    "nemotron_h": TINY_NEMOTRON_H,
    "nemotron_h_g1": dict(TINY_NEMOTRON_H, n_groups=1),
    "nemotron_h_moe": dict(TINY_NEMOTRON_H, layers_block_type=["mamba", "moe", "attention", "mamba", "mlp"]),
    "qwen3_next": TINY_QWEN3_NEXT,
}

#: The same tiny shape in every dense family the specs support (Llama-3: no qk-norm; Qwen2:
#: qkv bias, no qk-norm). Keys the family's config class does not know are dropped.
TINY_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": TINY_DENSE,
    "qwen3_moe": TINY_MOE,
    "llama": dict(TINY_DENSE, architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False),
    # Qwen2's config has no head_dim (it is hidden / heads): 128 / 4 keeps it at 32.
    "qwen2": dict(TINY_DENSE, architectures=["Qwen2ForCausalLM"], hidden_size=128, num_attention_heads=4),
    "deepseek_v3": TINY_DEEPSEEK_V3,
    # with one MTP layer (speculative decoding's draft, ``layout.mtp``)
    "deepseek_v3_mtp": dict(TINY_DEEPSEEK_V3, num_nextn_predict_layers=1),
    "qwen3_128": TINY_DENSE_128,
    **TINY_HYBRIDS,
    "qwen3_moe_128": TINY_MOE_128,
}

_CONFIG_CLASSES = {
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
    "LlamaForCausalLM": "LlamaConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "DeepseekV3ForCausalLM": "DeepseekV3Config",
    "NemotronHForCausalLM": "NemotronHConfig",
    "Qwen3NextForCausalLM": "Qwen3NextConfig",
}


def tiny_config(family: str = "qwen3", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The HF config dict of a tiny model of ``family`` (what ``config.json`` will hold)."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"tiny model family {family!r} is not one of {sorted(TINY_FAMILIES)}")
    return dict(TINY_FAMILIES[family], **(overrides or {}))


def make_tiny_checkpoint(path: str | Path, overrides: dict[str, Any] | None = None, *, moe: bool = False,
                         dtype: str = "float32", seed: int = 0, family: str | None = None,
                         weight_std: float = 0.05) -> Path:
    """Write a random-weight HF checkpoint to ``path`` and return it.

    ``family``: qwen3 (default; qwen3_moe when ``moe``), llama, qwen2 or deepseek_v3. Norm
    weights are randomised too (HF initialises them to ones, which would hide a norm mapped to
    the wrong tensor), and so are biases and DeepSeek's router bias (a buffer, zero in HF).
    Matrices are N(0, ``weight_std``): 0.05 by default (large enough that tests see every
    element); 0.02 is the ``initializer_range`` of published Qwen3 / Llama configs, the spread
    a delta refit's measurements use (how many bf16 elements a step changes depends on it).
    """
    import torch
    import transformers

    cfg_kwargs = tiny_config(family or ("qwen3_moe" if moe else "qwen3"), overrides)
    arch = cfg_kwargs["architectures"][0]
    config_cls = getattr(transformers, _CONFIG_CLASSES[arch])
    config = config_cls(**{k: v for k, v in cfg_kwargs.items() if k != "architectures"})
    config.architectures = [arch]
    torch.manual_seed(seed)
    model_cls = getattr(transformers, arch)
    model = model_cls(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            _randomize_(name, p, weight_std)
        for name, b in model.named_buffers():
            if name.endswith(_ROUTER_BIAS):
                _randomize_(name, b, weight_std)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if cfg_kwargs.get("num_nextn_predict_layers"):
        _write_mtp_layers(out, model.state_dict(), weight_std)
    return out


_ROUTER_BIAS = "e_score_correction_bias"


def _randomize_(name: str, x: "torch.Tensor", weight_std: float) -> "torch.Tensor":  # noqa: F821
    """``x`` drawn in place as the tiny checkpoints draw every tensor: DeepSeek's router bias
    N(0, 0.1), other vectors (norms, biases) 1 + N(0, 0.1), matrices N(0, ``weight_std``)."""
    import torch

    if name.endswith(_ROUTER_BIAS):
        x.copy_(0.1 * torch.randn_like(x))
    elif x.dim() == 1:
        x.copy_(1.0 + 0.1 * torch.randn_like(x))
    else:
        x.normal_(0.0, weight_std)
    return x


def _write_mtp_layers(out: Path, main: dict, weight_std: float) -> None:
    """DeepSeek-V3's MTP layers, which transformers' model does not build: random like the rest
    (``layout.mtp.draft_tensors``), plus the checkpoint's per-layer copies of the embedding and
    the output head, in a file of their own beside the model's."""
    import torch
    from safetensors.torch import save_file

    from ..layout.mtp import draft_tensors
    from ..layout.spec import load_model_spec

    spec = load_model_spec(out)
    tensors = {}
    for name, (shape, dt) in draft_tensors(spec).items():
        tensors[name] = _randomize_(name, torch.empty(shape, dtype=getattr(torch, dt)), weight_std)
    for layer in range(spec.num_layers, spec.num_layers + spec.mtp_layers):
        tensors[f"model.layers.{layer}.embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
        tensors[f"model.layers.{layer}.shared_head.head.weight"] = main["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})


def load_canonical(path: str | Path) -> dict[str, "torch.Tensor"]:  # noqa: F821
    """All tensors of a safetensors checkpoint directory, by HF name."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def save_peft_adapter(path: str | Path, config: dict, tensors: dict[str, "torch.Tensor"]) -> Path:  # noqa: F821
    """An HF PEFT adapter directory: ``adapter_config.json`` (``config``, e.g.
    ``PeftConfig.peft_config_json()``) and ``adapter_model.safetensors`` with the canonical
    adapter matrices under PEFT's ``base_model.model.`` prefix (what vLLM's ``LoRARequest`` loads)."""
    import json

    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"base_model.model." + n: t.contiguous() for n, t in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
