"""megatron-core's LLaVA (``models/multimodal/llava_model.LLaVAModel``) for a LLaVA spec, on CPU.

``build_llava`` builds what the family's table (``layout/families/llava.py``) describes: a
``CLIPViTModel`` tower (``vision_model_type="clip"``: class token, ``ln_pre``, LayerNorm,
quick-GELU, biases; the layers LLaVA uses, ``Vision.layers``), the MLP projector (column- then
row-parallel, GELU) and a ``GPTModel`` language model (the text config's, RoPE), all TP-sharded
over the model-parallel group. ``llava_forward`` runs it on a sequence as vLLM sees it: vLLM's
processor expands each image placeholder to one token per patch, megatron's ``LLaVAModel``
expands one token per image itself (``_preprocess_data``), so each run of placeholders is
collapsed to one token on the way in; the logits then line up with vLLM's positions.

Where the tower is frozen (``freeze_vision_model``), ``LLaVAModel.freeze`` sets
``requires_grad=False`` before the DDP wrapper and the optimizer see the parameters, as
Megatron-LM's ``pretrain_vlm.py`` does.
"""

from __future__ import annotations

from typing import Any, Sequence

from ...layout import LayoutError, ModelSpec
from .rules import MegatronParallel, padded_vocab

__all__ = ["build_llava", "llava_forward", "collapse_images"]


def _vision_config(spec: ModelSpec, par: MegatronParallel, dtype: str | None):
    """The CLIP tower's TransformerConfig (Megatron-LM's ``examples/multimodal/config.py``,
    ``clip``): LayerNorm, quick-GELU, biases on every linear, no GQA."""
    from dataclasses import replace

    from .build import _activation, megatron_config

    v = spec.vision
    base = megatron_config(spec, par, dtype)
    cfg = replace(base, num_layers=v.layers, hidden_size=v.hidden, num_attention_heads=v.heads,
                  num_query_groups=v.heads, kv_channels=v.head_dim, ffn_hidden_size=v.intermediate,
                  normalization="LayerNorm", layernorm_epsilon=v.layer_norm_eps, gated_linear_unit=False,
                  add_bias_linear=True, add_qkv_bias=True, qk_layernorm=False,
                  activation_func=_activation("quick_gelu"), num_moe_experts=None, moe_layer_freq=1)
    cfg.vision_model_type = "clip"  # read by LLaVAModel, not a TransformerConfig field
    return cfg


def _projection_config(spec: ModelSpec, par: MegatronParallel, dtype: str | None):
    """The projector's: an MLP from the tower's width to the language model's (``linear_1``
    is ``[T, H_vision]``), GELU (HF ``projector_hidden_act="gelu"``), biased unless
    ``multimodal_projector_bias`` is off."""
    from dataclasses import replace

    import torch.nn.functional as F

    from .build import megatron_config

    return replace(megatron_config(spec, par, dtype), ffn_hidden_size=spec.hidden, gated_linear_unit=False,
                   add_bias_linear=spec.vision.projector_bias, activation_func=F.gelu, num_moe_experts=None,
                   moe_layer_freq=1)


def build_llava(spec: ModelSpec, par: MegatronParallel, dtype: str | None = None, max_seq: int = 512) -> list:
    """One ``LLaVAModel`` (no pipeline or virtual stages: the rules refuse them for a VLM)."""
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    from .build import megatron_config, model_args
    from .runtime import apply_vision_cpu_patches

    if spec.vision is None or spec.family.tower is None:
        raise LayoutError(f"{spec.family.title} has no vision tower: build it with build_gpt")
    if par.pp > 1 or par.vpp > 1 or par.ep > 1:
        raise LayoutError(f"LLaVA policies are built with pp=1, vpp=1, ep=1 (got pp={par.pp}, vpp={par.vpp}, "
                          f"ep={par.ep})")
    apply_vision_cpu_patches()
    v = spec.vision
    language = megatron_config(spec, par, dtype)
    model = LLaVAModel(
        language_transformer_config=language,
        language_transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm),
        language_vocab_size=padded_vocab(spec, par),
        language_max_sequence_length=max_seq,
        vision_transformer_config=_vision_config(spec, par, dtype),
        vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        drop_vision_class_token=True,  # HF's vision_feature_select_strategy="default"
        vision_projection_config=_projection_config(spec, par, dtype),
        vision_projection_layer_spec=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        vision_projection_type="mlp",
        language_position_embedding_type="rope",
        language_rotary_base=model_args(spec)["rotary_base"],
        img_h=v.image, img_w=v.image, patch_dim=v.patch,
        image_token_index=v.image_token,
    )
    model.model_type = ModelType.encoder_or_decoder  # Megatron-LM's get_model sets it on every chunk
    return [model]


def collapse_images(tokens: Sequence[int], image_token: int, per_image: int) -> list[int]:
    """``tokens`` as vLLM's processor leaves them (``per_image`` placeholders per image) ->
    megatron's LLaVA input (one placeholder per image); one line where a run is not whole."""
    out: list[int] = []
    run = 0
    for t in list(tokens) + [None]:
        if t == image_token:
            run += 1
            continue
        if run:
            if run % per_image:
                raise ValueError(f"image placeholder run of {run} tokens is not a whole number of images of "
                                 f"{per_image} patches each (image_token_index={image_token})")
            out += [image_token] * (run // per_image)
            run = 0
        if t is not None:
            out.append(t)
    return out


def llava_forward(model, tokens: "Any", images: "Any", spec: ModelSpec) -> "Any":
    """Logits ``[1, T, V/tp]`` of the expanded sequence ``tokens`` (``[1, T]``, as vLLM runs
    it) with ``images`` (``[n, 3, H, W]`` pixel values, one per collapsed placeholder)."""
    import torch

    v = spec.vision
    ids = collapse_images(tokens[0].tolist(), v.image_token, v.patches)
    n = sum(1 for t in ids if t == v.image_token)
    if images is None:
        images = torch.zeros(0, v.channels, v.image, v.image)
    if images.shape[0] != n:
        raise ValueError(f"{n} image placeholders in the sequence, {images.shape[0]} images given")
    out, _ = model(images, torch.tensor([ids], dtype=torch.long), None, None,
                   num_image_tiles=torch.ones(n, dtype=torch.int32) if n else None)
    return out
