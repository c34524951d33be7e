"""A tiny vision-language checkpoint's extras, and synthetic images.

vLLM's multimodal processors need a tokenizer and an image processor (they refuse
``skip_tokenizer_init``), and the hub's LLaVA checkpoints name the CLIP tower
``vision_tower.vision_model.*`` where transformers 5 saves ``vision_tower.*``. With no hub
here, :func:`finish_vlm_checkpoint` renames the saved tensors to the hub form (what vLLM's
``llava.py`` loads) and writes a word-level tokenizer (one token per id, ``<image>`` at the
config's ``image_token_index``) and a ``LlavaProcessor`` with a CLIP image processor sized
to the tower. Prompts stay token ids: the tokenizer only lets vLLM's processor find and expand
the image placeholder.

:func:`colour_squares` draws the synthetic images the tests and the multimodal GRPO task use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["finish_vlm_checkpoint", "colour_squares", "COLOURS", "hub_names", "pixel_values", "is_vlm_checkpoint",
           "expand_images", "unused_tower"]

#: Hub form of a LLaVA checkpoint's tower (transformers 5 saves it without ``vision_model.``).
_TOWER, _HUB_TOWER = "vision_tower.", "vision_tower.vision_model."


def hub_names(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5's LLaVA tensor names -> the hub's (what vLLM's loader maps)."""
    out = {}
    for name, t in tensors.items():
        if name.startswith(_TOWER) and not name.startswith(_HUB_TOWER):
            name = _HUB_TOWER + name[len(_TOWER):]
        out[name] = t
    return out


def finish_vlm_checkpoint(out: Path, cfg: Mapping[str, Any]) -> None:
    """The saved checkpoint in the hub's form, and (LLaVA) its tokenizer and processor."""
    if cfg.get("model_type") == "qwen3_vl_moe":
        _qwen3_vl_hub_experts(out)
    elif cfg.get("model_type") == "llava":
        _finish_llava(out, cfg)


def _qwen3_vl_hub_experts(out: Path) -> None:
    """transformers 5 saves Qwen3-VL-MoE's stacked experts as it holds them, ``(E, 2FE, H)`` and
    ``(E, H, FE)``; the hub's checkpoints (and vLLM's loader, ``is_fused_checkpoint_transposed``)
    hold ``(E, H, 2FE)`` and ``(E, FE, H)``: transposed back here."""
    from safetensors.torch import load_file, save_file

    for f in sorted(Path(out).glob("*.safetensors")):
        tensors = load_file(str(f))
        fixed = {k: (v.transpose(1, 2).contiguous() if ".mlp.experts." in k and v.dim() == 3 else v)
                 for k, v in tensors.items()}
        save_file(fixed, str(f), metadata={"format": "pt"})


def _finish_llava(out: Path, cfg: Mapping[str, Any]) -> None:
    """Rename the saved tower to the hub form; write the tokenizer and the processor."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    for f in sorted(Path(out).glob("*.safetensors")):
        save_file({k: v.contiguous() for k, v in hub_names(load_file(str(f))).items()}, str(f), metadata={"format": "pt"})
    text, vision = cfg["text_config"], cfg["vision_config"]
    image_token = int(cfg["image_token_index"])
    vocab = {f"t{i}": i for i in range(int(text["vocab_size"]))}
    vocab = {("<image>" if i == image_token else name): i for name, i in vocab.items()}
    tok = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1",
                                        bos_token="t2")
    size = int(vision["image_size"])
    images = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=int(vision["patch_size"]),
                               vision_feature_select_strategy=cfg.get("vision_feature_select_strategy", "default"),
                               image_token="<image>", num_additional_image_tokens=1)
    processor.save_pretrained(out)


def unused_tower(names: Sequence[str], layers: int) -> set[str]:
    """Of a LLaVA checkpoint's ``names``, the tower tensors LLaVA never computes with: the
    encoder layers from ``layers`` on (after ``vision_feature_layer``) and ``post_layernorm``
    (neither library builds them; the family's table leaves them out)."""
    out = set()
    for n in names:
        if not n.startswith(_HUB_TOWER):
            continue
        rest = n[len(_HUB_TOWER):]
        if rest.startswith("post_layernorm."):
            out.add(n)
        elif rest.startswith("encoder.layers.") and int(rest.split(".")[2]) >= layers:
            out.add(n)
    return out


def expand_images(tokens: Sequence[int], image_token: int, per_image: int) -> list[int]:
    """A prompt with one placeholder per image, as vLLM's processor expands it (``per_image``
    placeholders each, LLaVA's one per patch): the sequence the engine runs and reports, and
    the one a trainer scores."""
    out: list[int] = []
    for t in tokens:
        out += [t] * (per_image if t == image_token else 1)
    return out


def is_vlm_checkpoint(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` is a vision-language model's (its config has a
    ``vision_config``): its engines need the tokenizer and the image processor."""
    import json

    try:
        return "vision_config" in json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def pixel_values(path: str | Path, images: Sequence[Any]):
    """``images`` (PIL) as the checkpoint's image processor gives them to the model, the same
    preprocessing vLLM's processor runs: ``[n, 3, H, W]`` fp32."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(path))(images=list(images), return_tensors="pt")["pixel_values"]


#: The colours of :func:`colour_squares`' squares, by name.
COLOURS: dict[str, tuple[int, int, int]] = {"red": (230, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 230)}


def colour_squares(size: int, squares: Sequence[tuple[str, int, int, int]], background=(245, 245, 245)):
    """A ``size`` x ``size`` RGB PIL image with squares ``(colour, x, y, side)`` drawn on it."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(img)
    for colour, x, y, side in squares:
        draw.rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[colour])
    return img
