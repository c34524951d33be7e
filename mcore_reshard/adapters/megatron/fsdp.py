"""Megatron-FSDP (``use_megatron_fsdp``; NeMo RL's ``use_custom_fsdp``) as a refit source.

Megatron-FSDP (``distributed/fsdp``) keeps each parameter, gradient and optimizer state only
as this rank's slice of a flat bucket (``optim_grads_params``). Each bucket's items are laid
out so that every rank's slice of a parameter is whole rows of its TP-local tensor (a bucket's
``chunk_size_factor`` is a row, ``make_fsdp_dtensor`` views a slice as ``(-1, *shape[1:])``),
so a rank holds rows ``[first, first + rows)`` of the tensor megatron's rules describe: the
rules' pieces cut to those rows (``layout.rows``) describe it, and the planner draws each
destination element from the one rank that holds it. No rank gathers a parameter to refit.

Two buffers hold a slice: the model weights (what a forward all-gathers; bf16 under mixed
precision) and the main weights (fp32, what the optimizer steps; the module's DTensor
parameters). A refit reads the model weights -- what the policy computes with -- and writing
weights (``load_canonical``) writes the model weights and copies them into the main ones,
which megatron-core's ``reload_model_params`` does not do under FSDP.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

__all__ = ["is_fsdp", "fsdp_weights", "fsdp_rows", "copy_model_to_main"]


def is_fsdp(chunk: Any) -> bool:
    """Whether ``chunk`` is wrapped by Megatron-FSDP (its adapter around ``MegatronFSDP``)."""
    return getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False)


def _items(chunk: Any) -> Iterator[tuple[str, Any, int, Any]]:
    """(name as the bare model names it, parameter group, item id, parameter) of every parameter."""
    buf = chunk.module.param_and_grad_buffer
    for group in buf.parameter_groups:
        for item_id, p in enumerate(group.params):
            name = buf.param_to_name[p]
            while name.startswith("module."):  # Float16Module's
                name = name[len("module."):]
            yield name, group, item_id, p


def _rows_view(flat: Any, shape: Sequence[int]) -> Any:
    return flat.view(-1, *shape[1:]) if len(shape) > 1 else flat


def fsdp_weights(chunk: Any) -> dict[str, Any]:
    """This rank's slice of every parameter's model weights (storage, not a copy), by name."""
    return {name: _rows_view(group.model_weight_buffer.get_item(item_id, only_shard=True), p.shape)
            for name, group, item_id, p in _items(chunk)}


def copy_model_to_main(chunk: Any) -> None:
    """Copy this rank's model-weight slices into its main-weight slices (after writing them)."""
    import torch

    with torch.no_grad():
        for _, group, item_id, _ in _items(chunk):
            if group.main_weight_buffer is not None:
                group.main_weight_buffer.get_item(item_id, only_shard=True).copy_(
                    group.model_weight_buffer.get_item(item_id, only_shard=True))


def fsdp_rows(model_chunks: Sequence, named: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(first row, rows) of each parameter this rank holds, within its TP-local tensor
    (collective over the world). ``named``: the rules' names of this rank's FSDP slices.

    A rank's first row is the rows the ranks before it in the parameter's data-parallel shard
    group hold (as Megatron-FSDP's ``gather_and_compute_chunk_metadata`` counts them): every
    parameter's row count gathered at once, as JSON."""
    import torch.distributed as dist

    from ...transport.source import all_gather_json

    groups = {}
    for v, chunk in enumerate(model_chunks):
        prefix = f"chunk{v}." if len(model_chunks) > 1 else ""
        for name, group, _, _ in _items(chunk):
            buf = group.model_weight_buffer  # sharded over this group, in its rank order
            groups[prefix + name] = dist.get_process_group_ranks(buf.data_parallel_group) \
                if buf.is_data_distributed else [dist.get_rank()]
    mine = {name: int(t.shape[0]) for name, t in named.items()}
    every = all_gather_json(mine)
    me = dist.get_rank()
    return {name: (sum(every[r][name] for r in groups[name][: groups[name].index(me)]), rows)
            for name, rows in mine.items()}
