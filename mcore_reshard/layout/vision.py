"""What a vision-language family's spec carries beyond its language model: the vision tower's
sizes and how the language model takes its output (LLaVA's CLIP tower and MLP projector).

The table (``layout/families/llava.py``) reads these. Metadata only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .descriptor import LayoutError

__all__ = ["Vision", "read_vision", "QwenVision", "read_qwen_vision", "qwen_tp_sizes"]


@dataclass(frozen=True, slots=True)
class Vision:
    """A CLIP-style vision tower and its projector (HF ``CLIPVisionConfig`` names in comments)."""

    kind: str  # the tower's HF model_type ("clip_vision_model")
    hidden: int  # hidden_size
    #: The tower layers the model uses: LLaVA takes ``vision_feature_layer``'s output, so the
    #: layers after it (and ``post_layernorm``) are in the checkpoint but in neither library's
    #: model (vLLM's ``_get_num_hidden_layers``; megatron-core builds that many layers).
    layers: int
    checkpoint_layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    intermediate: int  # intermediate_size
    image: int  # image_size
    patch: int  # patch_size
    channels: int = 3  # num_channels
    projector_bias: bool = True  # multimodal_projector_bias
    image_token: int = -1  # image_token_index: the placeholder the processor expands per patch
    layer_norm_eps: float = 1e-5

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2

    @property
    def positions(self) -> int:
        """Position embeddings: the patches and the class token."""
        return self.patches + 1

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def read_vision(cfg: Mapping[str, Any]) -> Vision:
    """A LLaVA config's tower, or one line naming what the table does not describe."""
    v = cfg.get("vision_config") or {}
    kind = v.get("model_type", "clip_vision_model")
    if kind != "clip_vision_model":
        raise LayoutError(f"LLaVA vision_config.model_type={kind!r}: the table describes the CLIP tower "
                          f"(clip_vision_model) only")
    if cfg.get("vision_feature_select_strategy", "default") != "default":
        raise LayoutError(f"LLaVA vision_feature_select_strategy={cfg['vision_feature_select_strategy']!r}: "
                          f"megatron-core's LLaVAModel drops the class token ('default') only")
    n = int(v.get("num_hidden_layers", 24))
    feature = cfg.get("vision_feature_layer", -2)
    if not isinstance(feature, int):
        raise LayoutError(f"LLaVA vision_feature_layer={feature!r}: one layer (an int) is described, not a list")
    used = n + feature + 1 if feature < 0 else feature
    if not 1 <= used <= n:
        raise LayoutError(f"LLaVA vision_feature_layer={feature} is outside the tower's {n} layers")
    hidden, heads = int(v.get("hidden_size", 1024)), int(v.get("num_attention_heads", 16))
    if hidden % heads:
        raise LayoutError(f"vision_config.hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    return Vision(kind=kind, hidden=hidden, layers=used, checkpoint_layers=n, heads=heads,
                  intermediate=int(v.get("intermediate_size", 4096)), image=int(v.get("image_size", 336)),
                  patch=int(v.get("patch_size", 14)), channels=int(v.get("num_channels", 3)),
                  projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
                  image_token=int(cfg.get("image_token_index", cfg.get("image_token_id", -1))),
                  layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)))


@dataclass(frozen=True, slots=True)
class QwenVision:
    """Qwen3-VL's vision tower (HF ``Qwen3VLVisionConfig`` names in comments): a ViT over
    3-D patches with learned position embeddings, a patch merger into the language model's
    width, and deepstack mergers whose outputs are added to early language-model layers."""

    hidden: int  # hidden_size
    layers: int  # depth (every block is used)
    heads: int  # num_heads
    intermediate: int  # intermediate_size
    patch: int  # patch_size
    temporal_patch: int  # temporal_patch_size
    merge: int  # spatial_merge_size
    positions: int  # num_position_embeddings
    out_hidden: int  # out_hidden_size (the language model's hidden size)
    deepstack: tuple[int, ...] = ()  # deepstack_visual_indexes
    channels: int = 3  # in_channels

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def merged(self) -> int:
        """The mergers' width: ``spatial_merge_size ** 2`` patches side by side."""
        return self.hidden * self.merge * self.merge


def read_qwen_vision(cfg: Mapping[str, Any], text_hidden: int) -> QwenVision:
    """A Qwen3-VL config's tower, or one line naming what the table does not describe."""
    v = cfg.get("vision_config") or {}
    hidden, heads = int(v.get("hidden_size", 1152)), int(v.get("num_heads", 16))
    if hidden % heads:
        raise LayoutError(f"vision_config.hidden_size={hidden} is not a multiple of num_heads={heads}")
    out = int(v.get("out_hidden_size", text_hidden))
    if out != text_hidden:
        raise LayoutError(f"vision_config.out_hidden_size={out} differs from text_config.hidden_size={text_hidden}")
    depth = int(v.get("depth", 27))  # Qwen2.5-VL's blocks are all used too (window or full attention)
    deep = tuple(int(i) for i in v.get("deepstack_visual_indexes") or ())
    if any(not 0 <= i < depth for i in deep):
        raise LayoutError(f"vision_config.deepstack_visual_indexes={list(deep)} leave the tower's {depth} blocks")
    return QwenVision(hidden=hidden, layers=depth, heads=heads, intermediate=int(v.get("intermediate_size", 4304)),
                      patch=int(v.get("patch_size", 16)), temporal_patch=int(v.get("temporal_patch_size", 2)),
                      merge=int(v.get("spatial_merge_size", 2)), positions=int(v.get("num_position_embeddings", 2304)),
                      out_hidden=out, deepstack=deep, channels=int(v.get("in_channels", v.get("in_chans", 3))))


def qwen_tp_sizes(spec: Any, mlp: str, merger: str) -> tuple[tuple[str, int, str], ...]:
    """What a TP that shards a Qwen VL tower must divide (``Tower.tp_sizes``): its heads, its
    MLP (``mlp``: the tensor that cuts it) and its merger's width (``merger``)."""
    v = spec.vision
    return (("vision_config.num_heads", v.heads, "attn.qkv"), ("vision_config.intermediate_size", v.intermediate, mlp),
            ("the merger's width hidden_size * spatial_merge_size**2", v.merged, merger))
