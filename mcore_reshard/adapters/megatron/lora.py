"""A LoRA policy on megatron-core: Megatron-Bridge's adapters on the attention and MLP linears,
the base weights frozen.

Megatron-Bridge does not install here (``docs/lora.md``), so its ``ParallelLinearAdapter``
(``megatron/bridge/peft/utils.py``) is written again from megatron-core's own parallel linears,
in the layout ``lora_rules.py`` describes:

- a column-parallel base (``linear_qkv``, ``linear_fc1``): ``linear_in`` is a
  ``ColumnParallelLinear(in, r, gather_output=True)`` (A split along the rank) and
  ``linear_out`` a ``ColumnParallelLinear(r, out)`` (B split along the base's own output rows);
- a row-parallel base (``linear_proj``, ``linear_fc2``): ``linear_in`` is a
  ``RowParallelLinear(in, r, input_is_parallel=True)`` (A split along the input columns, its
  output all-reduced) and ``linear_out`` a ``ColumnParallelLinear(r, out, gather_output=True)``.

The adapter is a submodule of its base (``<module>.adapter.linear_in.weight``) added to the
base's output by a forward hook, so the base keeps its parameter names (Bridge moves them under
``to_wrap``; the base layout then differs by that prefix only). The adapter computes
``alpha / r * B A x`` as Bridge and PEFT do. Sequence parallelism is refused: Bridge scatters the
adapter's output there, which is not written here.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ...layout import LayoutError, ModelSpec
from ...layout.lora import PeftConfig, module_io

__all__ = ["add_lora", "policy_peft", "PEFT_ATTR"]

#: The attribute of a ``GPTModel`` that holds its ``PeftConfig`` (``live.describe`` reads it).
PEFT_ATTR = "mcore_reshard_peft"

_COLUMN = ("linear_qkv", "linear_fc1")


def _init(method: str) -> Any:
    """Megatron-Bridge's ``lora_A_init_method`` / ``lora_B_init_method`` names."""
    import torch

    return {
        "xavier": torch.nn.init.xavier_normal_,
        "normal": lambda w: torch.nn.init.normal_(w, 0.0, 0.2),
        "kaiming": lambda w: torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5)),
        "zero": torch.nn.init.zeros_,
    }[method]


def _adapter(config: Any, base_in: int, base_out: int, peft: PeftConfig, column: bool, is_expert: bool = False) -> Any:
    """One ``ParallelLinearAdapter`` (global ``in``/``out`` features of its base; ``is_expert``:
    a routed expert's linear, split over the expert-TP group as its base is)."""
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class ParallelLinearAdapter(torch.nn.Module):
        """``alpha / r * B(A(x))`` with A and B as megatron parallel linears (module docstring)."""

        def __init__(self) -> None:
            super().__init__()
            a, b = _init(peft.lora_A_init_method), _init(peft.lora_B_init_method)
            if column:
                self.linear_in = ColumnParallelLinear(base_in, peft.dim, config=config, init_method=a, bias=False,
                                                      gather_output=True, is_expert=is_expert)
                self.linear_out = ColumnParallelLinear(peft.dim, base_out, config=config, init_method=b, bias=False,
                                                       gather_output=False, is_expert=is_expert)
            else:
                self.linear_in = RowParallelLinear(base_in, peft.dim, config=config, init_method=a, bias=False,
                                                   input_is_parallel=True, skip_bias_add=True, is_expert=is_expert)
                self.linear_out = ColumnParallelLinear(peft.dim, base_out, config=config, init_method=b, bias=False,
                                                       gather_output=True, is_expert=is_expert)
            self.dropout = torch.nn.Dropout(peft.dropout)
            self.scale = peft.scaling

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if peft.dropout_position == "pre":
                x = self.dropout(x)
            x, _ = self.linear_in(x)
            x, _ = self.linear_out(x)
            if peft.dropout_position == "post":
                x = self.dropout(x)
            return x * self.scale

    return ParallelLinearAdapter()


def _add_adapter_output(module: Any, args: tuple, output: Any) -> Any:
    """Forward hook of an adapted linear: its ``(output, bias)`` plus the adapter's output."""
    out, bias = output
    return out + module.adapter(args[0]), bias


def _adapt(base: Any, config: Any, io: tuple[int, int], peft: PeftConfig, module: str, is_expert: bool) -> None:
    base.adapter = _adapter(config, *io, peft, module in _COLUMN, is_expert)
    base.register_forward_hook(_add_adapter_output)


def add_lora(chunks: Sequence[Any], spec: ModelSpec, peft: PeftConfig) -> None:
    """Adapt every targeted linear of the bare ``GPTModel`` chunks (before ``Float16Module`` and
    DDP wrap them: the adapters then take the model dtype, and DDP and the optimizer see only
    them) and freeze every other parameter."""
    from ...layout.lora import check_lora

    check_lora(spec, peft)
    config = chunks[0].config
    if config.sequence_parallel:
        raise LayoutError("peft.enabled with sequence_parallel=true: the adapters' sequence-parallel scatter "
                          "(Megatron-Bridge's) is not written here; turn sequence_parallel off for a LoRA policy")
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for layer in chunk.decoder.layers:
            number = layer.layer_number - 1  # global, 1-based in megatron
            for module in peft.modules:
                if module in ("linear_fc1", "linear_fc2") and spec.is_moe(number):
                    for expert in layer.mlp.experts.local_experts:  # SequentialMLP (the rules refuse grouped)
                        _adapt(getattr(expert, module), config, module_io(spec, module, expert=True), peft,
                               module, True)
                    continue
                parent = layer.self_attention if module in ("linear_qkv", "linear_proj") else layer.mlp
                _adapt(getattr(parent, module), config, module_io(spec, module), peft, module, False)
        setattr(chunk, PEFT_ATTR, peft)


def policy_peft(model: Any) -> PeftConfig | None:
    """The LoRA settings of a (bare) ``GPTModel`` chunk, or None for a full policy."""
    return getattr(model, PEFT_ATTR, None)
