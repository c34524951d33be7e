"""A rank of a DTensor policy as a refit source: each parameter's local shard as one box of its
canonical tensor, read from its mesh and placements.

The project's descriptors are DTensor-equivalent (``layout/dtensor.py`` prints every layout's
``Shard``/``Replicate``/``_StridedShard`` form); this is the other direction. Where the local
shard of a parameter sits in the global tensor is what torch's own
``compute_local_shape_and_global_offset`` says -- the function DTensor's checkpoint metadata
(DCP's chunk list) is built from -- so FSDP2's ``Shard(0)`` over the data-parallel mesh
dimension, tensor parallelism's ``Shard`` on the other, and the ``_StridedShard`` FSDP2 puts
over a TP-sharded dimension all come out as they do in a distributed checkpoint. Ranks that
hold the same box (``Replicate`` on a mesh dimension) are replicas: the planner sends each box
once, from whichever of them carries the least load. No rank gathers a parameter to refit it.

Refused in one line, before a byte moves (``LayoutError``, naming the parameter): a name with
no canonical tensor, a global shape other than the canonical one, a ``Partial`` placement (a
pending reduction: not yet a value), a local shard that is not the box torch places it at.

**Replicas that differ.** The planner takes any replica of a box as the box. A parameter that
a TP plan leaves replicated over the TP ranks while its gradient there depends on the rank's
own shard (Qwen3's per-head ``q_norm``/``k_norm`` under a plan that shards the attention heads:
each TP rank sees only its heads) drifts apart on the TP ranks from the first optimizer step,
and the policy is no longer one model. The endpoint checks it before every refit
(``check_replicas``, on by default): the exact checksums of every replicated piece, compared
across the ranks holding it; a difference refuses the refit on every rank, in one line naming
the parameter and the ranks, and the engine keeps its weights. (NeMo AutoModel makes such
parameters DTensors on the TP dimension -- its ``NoParallel`` style -- so their gradients are
reduced there.)
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterable, Mapping

import torch

from ...layout import LayoutError, LocalParam, ModelSpec
from ...layout.descriptor import Box, Piece, View, contiguous_strides
from ...transport.checksum import checksums
from ...transport.participant import IN_PLACE, InPlace, Participant, TopLogprobs
from ...transport.source import SourceEndpoint, all_gather_json

__all__ = ["dtensor_params", "DTensorEndpoint", "canonical_name"]

#: Module-path parts that wrappers add to a parameter's name and HF's names do not have
#: (``torch.compile``'s, activation checkpointing's, FSDP1's).
WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def canonical_name(fqn: str) -> str:
    """``fqn`` without the parts wrappers add (``WRAPPER_PARTS``): the HF name."""
    return ".".join(p for p in fqn.split(".") if p not in WRAPPER_PARTS)


def _local(p: torch.Tensor) -> torch.Tensor:
    """``p``'s local shard (a plain tensor is whole): the optimizer's own storage, not a copy."""
    from torch.distributed.tensor import DTensor

    return p.to_local().detach() if isinstance(p, DTensor) else p.detach()


def _box(fqn: str, p: torch.Tensor) -> tuple[Box, torch.Tensor]:
    """Where ``p``'s local shard sits in its global tensor, and the local shard itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return Box.full(tuple(p.shape)), _local(p)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(pl.is_partial() for pl in p.placements):
        raise LayoutError(f"parameter {fqn}: placements {tuple(p.placements)} hold a Partial (a pending reduction, "
                          f"not yet a value): reduce it before a refit")
    shape, offset = compute_local_shape_and_global_offset(tuple(p.shape), p.device_mesh, p.placements)
    local = _local(p)
    if tuple(local.shape) != tuple(shape):
        raise LayoutError(f"parameter {fqn}: its local shard is {tuple(local.shape)}, but placements "
                          f"{tuple(p.placements)} over mesh {tuple(p.device_mesh.shape)} place a box of {tuple(shape)} "
                          f"at {tuple(offset)}: not one box of the global tensor")
    return Box(tuple(int(o) for o in offset), tuple(int(s) for s in shape)), local


def dtensor_params(named: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec, rank: int,
                   names: Callable[[str], str] = canonical_name) -> list[LocalParam]:
    """Rank ``rank``'s pieces: one per parameter in ``named`` (``model.named_parameters()``;
    DTensors or plain tensors, which are whole), named by ``names(fqn)`` in ``spec``. A shard
    with no elements (more ranks than rows) holds nothing and is left out. Refusals: see the
    module docstring."""
    table = spec.tensor_table()
    out: list[LocalParam] = []
    for fqn, p in named:
        canonical = names(fqn)
        if canonical not in table:
            raise LayoutError(f"parameter {fqn}: {canonical!r} is not a tensor of {spec.name or 'the model'} "
                              f"(the names must be HF's; pass names= to map them)")
        shape, _ = table[canonical]
        if tuple(p.shape) != tuple(shape):
            raise LayoutError(f"parameter {fqn}: global shape {tuple(p.shape)}, but {canonical} is {tuple(shape)}")
        box, local = _box(fqn, p)
        if box.numel == 0:
            continue
        view = View(0, box.sizes, contiguous_strides(box.sizes))
        dtype = str(local.dtype).removeprefix("torch.")
        out.append(LocalParam(rank, fqn, box.sizes, dtype, (Piece(rank, fqn, canonical, box, view),)))
    return out


class DTensorEndpoint(SourceEndpoint):
    """A DTensor policy's rank as a refit source: ``model``'s parameters (``named_parameters``,
    with ``names`` mapping their names to HF's) described by their placements, sent from their
    local shards. Give it to vLLM's trainer API as ``TrainerShards(DTensorEndpoint(model, spec))``."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, *, rank: int | None = None, device: str = "cpu",
                 names: Callable[[str], str] = canonical_name, check_replicas: bool = True,
                 canary: TopLogprobs | None = None) -> None:
        super().__init__(spec, rank=rank, device=device, canary=canary)
        self.model = model
        self.names = names
        self.check_replicas = check_replicas
        self._params: list[LocalParam] | None = None
        self._replicated: list[tuple[str, str]] | None = None  # (local name, piece key) others hold too
        self._diverged = ""

    def sync(self) -> None:
        """Before each refit, on every trainer rank at once: the parameters back to their shards
        (:meth:`reshard`), and whether replicated pieces still agree (``check_replicas``; see
        the module docstring)."""
        self.reshard()
        self._diverged = self.replicas_differ() if self.check_replicas else ""

    def reshard(self) -> None:
        """Every FSDP2 module's parameters back to their sharded DTensors. FSDP2 leaves the root
        module's parameters unsharded after a forward (its ``reshard_after_forward`` is off for
        the root, whose backward follows at once): after a forward-only pass -- a logprob
        computation -- the root's embedding, final norm and head are plain whole tensors until
        the next backward, and reading them as shards would send the wrong rows."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def participant(self) -> Participant:
        return _Refuses(self._diverged) if self._diverged else IN_PLACE

    def replicas_differ(self) -> str:
        """"" when every piece held by several trainer ranks has the same bits on each; else
        one line naming what differs. Collective over the trainers' default process group."""
        if self._replicated is None:  # which pieces other ranks hold too: fixed by the placements
            keys = [_key(p) for p in self.describe()]
            held = Counter(k for rank_keys in all_gather_json(keys) for k in rank_keys)
            self._replicated = [(p.name, k) for p, k in zip(self.describe(), keys) if held[k] > 1]
        local = self.local_tensors()
        sums = checksums([local[name] for name, _ in self._replicated]).tolist() if self._replicated else []
        first: dict[str, tuple[int, list[int]]] = {}
        differ: list[tuple[str, int, int]] = []
        for rank, mine in enumerate(all_gather_json({k: s for (_, k), s in zip(self._replicated, sums)})):
            for k, s in mine.items():
                r0, s0 = first.setdefault(k, (rank, s))
                if s0 != s:
                    differ.append((k, r0, rank))
        if not differ:
            return ""
        k, a, b = differ[0]
        names = sorted({d[0].split("[")[0] for d in differ})
        return (f"{len(names)} replicated parameter(s) differ between the trainer ranks holding them, e.g. {k} on "
                f"ranks {a} and {b} (a parameter replicated over a mesh dimension whose gradients are not reduced "
                f"over it: make it a DTensor on that dimension); a refit would serve one replica: {', '.join(names[:4])}")

    def describe(self) -> list[LocalParam]:
        """This rank's pieces (cached: placements do not change between refits)."""
        if self._params is None:
            self._params = dtensor_params(self.model.named_parameters(), self.spec, self.rank, self.names)
        return self._params

    def local_tensors(self) -> Mapping[str, Any]:
        """Every described parameter's local shard, by its name (the optimizer's own storage:
        read, never copied; where it sits was worked out once, by :meth:`describe`)."""
        held = {lp.name: lp for lp in self.describe()}
        out = {}
        for fqn, p in self.model.named_parameters():
            lp = held.get(fqn)
            if lp is None:
                continue
            local = _local(p)
            if tuple(local.shape) != tuple(lp.shape):
                raise LayoutError(f"parameter {fqn}: its local tensor is {tuple(local.shape)}, described as the box "
                                  f"{lp.pieces[0].box} (unsharded since it was described? call reshard() first)")
            out[fqn] = local
        return out


def _key(p: LocalParam) -> str:
    """A piece's identity across ranks: its canonical tensor and box (``name[0:32, 0:64]``)."""
    q = p.pieces[0]
    return f"{q.canonical}[{', '.join(f'{o}:{o + n}' for o, n in zip(q.box.offsets, q.box.sizes))}]"


class _Refuses(InPlace):
    """A sending rank's participant that refuses the refit at ``open``, before a byte moves
    (its "no" vote: every rank aborts at once and the engines keep their weights); otherwise
    a sender's (``InPlace``)."""

    def __init__(self, why: str) -> None:
        self.why = why

    def open(self, request: Any) -> bool:
        raise LayoutError(self.why)
