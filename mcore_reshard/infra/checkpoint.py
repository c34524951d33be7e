"""HF checkpoints on disk: read one as canonical tensors, or write a tiny random one.

``load_canonical`` is how a refit job and the tests load weights by HF name. The tiny random
checkpoints (one per model family, ``layout.families``), written by transformers, are the
built-in models of the demo job and the tests: no hub and no tokenizer, token ids in and out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..layout.families import FAMILIES, family_of_config
from ..layout.families.deepseek_v3 import TINY_DEEPSEEK_V3
from ..layout.families.dense import TINY_QWEN3
from ..layout.families.nemotron_h import TINY_NEMOTRON_H
from ..layout.families.qwen3_moe import TINY_QWEN3_MOE

__all__ = ["TINY_DENSE", "TINY_MOE", "TINY_DEEPSEEK_V3", "TINY_DENSE_128", "TINY_MOE_128", "TINY_FAMILIES", "tiny_config", "make_tiny_checkpoint", "load_canonical", "checkpoint_form",
           "plan_shapes"]

#: Every family's tiny config is written with its table (``layout.families``): Qwen3 dense
#: (GQA with P = 4, qk-norm, vocab not a multiple of 64), Qwen3-MoE, DeepSeek-V3 (MLA, shared
#: expert, router bias, a dense first layer) and the rest.
TINY_DENSE: dict[str, Any] = TINY_QWEN3
TINY_MOE: dict[str, Any] = TINY_QWEN3_MOE

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

#: Every family's tiny model by family name, and a few variants: DeepSeek-V3 with one MTP
#: layer (speculative decoding's draft, ``layout.mtp``) and the FP8 rollout's 128-wide models.
#: Keys the family's config class does not know are dropped.
TINY_FAMILIES: dict[str, dict[str, Any]] = {
    **{name: dict(fam.tiny) for name, fam in FAMILIES.items()},
    "deepseek_v3_mtp": dict(TINY_DEEPSEEK_V3, num_nextn_predict_layers=1),
    "qwen3_128": TINY_DENSE_128,
    "qwen3_moe_128": TINY_MOE_128,
    # Nemotron-H with one Mamba group (vLLM replicates it on every TP rank), and with a MoE layer
    # (non-gated relu2 experts: vLLM's CPU FusedMoE refuses them, ``is_act_and_mul=False``)
    "nemotron_h_g1": dict(TINY_NEMOTRON_H, n_groups=1),
    "nemotron_h_moe": dict(TINY_NEMOTRON_H, layers_block_type=["mamba", "moe", "attention", "mamba", "mlp"]),
}


def tiny_config(family: str = "qwen3", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The HF config dict of a tiny model of ``family`` (what ``config.json`` will hold)."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"tiny model family {family!r} is not one of {sorted(TINY_FAMILIES)}")
    return dict(TINY_FAMILIES[family], **(overrides or {}))


def make_tiny_checkpoint(path: str | Path, overrides: dict[str, Any] | None = None, *, moe: bool = False,
                         dtype: str = "float32", seed: int = 0, family: str | None = None,
                         weight_std: float | None = None) -> Path:
    """Write a random-weight HF checkpoint to ``path`` and return it.

    ``family``: qwen3 (default; qwen3_moe when ``moe``), llama, qwen2 or deepseek_v3. Norm
    weights are randomised too (HF initialises them to ones, which would hide a norm mapped to
    the wrong tensor), and so are biases and DeepSeek's router bias (a buffer, zero in HF).
    Matrices are N(0, ``weight_std``): by default the family's ``tiny_std``, 0.05 for most
    (large enough that tests see every element; gpt-oss 0.2: at 0.02 its tiny model repeats one
    token under greedy decoding); 0.02 is the ``initializer_range`` of published Qwen3 / Llama
    configs, the spread a delta refit's measurements use (how many bf16 elements a step changes
    depends on it).
    """
    import torch
    import transformers

    cfg_kwargs = tiny_config(family or ("qwen3_moe" if moe else "qwen3"), overrides)
    arch = cfg_kwargs["architectures"][0]
    fam = family_of_config(cfg_kwargs)
    model_type = fam.model_types[0]
    weight_std = fam.tiny_std if weight_std is None else weight_std
    config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in cfg_kwargs.items()
                                                              if k not in ("architectures", "model_type")})
    config.architectures = [arch]
    torch.manual_seed(seed)
    model_cls = getattr(transformers, arch)
    model = model_cls(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            _randomize_(name, p, weight_std, fam.tiny_biases)
        for name, b in model.named_buffers():
            if name.endswith(_ROUTER_BIAS):
                _randomize_(name, b, weight_std)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if fam.tower is not None:  # the hub's tower names, a tokenizer and a processor (vLLM's multimodal path)
        from .vlm import finish_vlm_checkpoint

        finish_vlm_checkpoint(out, cfg_kwargs)
    if cfg_kwargs.get("num_nextn_predict_layers"):
        _write_mtp_layers(out, model.state_dict(), weight_std)
    return out


_ROUTER_BIAS = "e_score_correction_bias"


def _randomize_(name: str, x: "torch.Tensor", weight_std: float, biases: str = "one") -> "torch.Tensor":  # noqa: F821
    """``x`` drawn in place as the tiny checkpoints draw every tensor: DeepSeek's router bias
    N(0, 0.1), other vectors (norms, biases) 1 + N(0, 0.1), matrices N(0, ``weight_std``).
    ``biases="zero"`` (the family's ``tiny_biases``): biases N(0, 0.1) instead -- a LLaVA tower
    whose every bias is near 1 would drown what an image says in constants."""
    import torch

    if name.endswith(_ROUTER_BIAS) or (biases == "zero" and name.endswith(".bias")):
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
    """All tensors of a safetensors checkpoint directory, by HF name, in the plan's shapes: a
    tensor the family's table addresses in a finer shape of the same storage (gpt-oss's
    interleaved gate/up, ``ModelSpec.checkpoint_shapes``) is reshaped to it (a view)."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for name, shape in plan_shapes(path).items():
        if name in tensors:
            tensors[name] = tensors[name].reshape(shape)
    return tensors


def plan_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> the plan's shape of each tensor whose checkpoint shape differs (none when the
    directory has no ``config.json``)."""
    from ..layout.spec import load_model_spec

    if not (Path(path) / "config.json").is_file():
        return {}
    spec = load_model_spec(path)
    table = spec.tensor_table()
    return {name: table[name][0] for name in spec.checkpoint_shapes()}


def checkpoint_form(tensors: dict[str, "torch.Tensor"], spec: Any) -> dict[str, "torch.Tensor"]:  # noqa: F821
    """``tensors`` (canonical, the plan's shapes) as an HF checkpoint holds them: the inverse
    of :func:`load_canonical`'s reshape, before a save or vLLM's own ``load_weights``."""
    shapes = spec.checkpoint_shapes()
    return {n: (t.reshape(shapes[n]) if n in shapes else t) for n, t in tensors.items()}


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
