"""The canary vote on a vLLM worker: what the engine computes on the new weights, before they serve.

Checksums prove that every box arrived where the plan put it. They cannot see a plan that is
wrong the same way on both sides, nor state vLLM derives from the weights after loading that
was not rebuilt. So with ``refit.canary`` on, each worker runs its model on a few fixed token
sequences (``wire.protocol.Canary``) over the weights it is about to serve and votes no when the
prompt logprobs differ from the trainers' by more than the bound.

The forward is vLLM's own model (its kernels, its repacked and derived tensors) run outside the
scheduler, so no client request is ever scheduled on weights that have not passed: the
sequences as one batch of requests, one prefill and then one decode step reading their KV cache
(state only decoding reads, such as MLA's absorbed ``W_UK``/``W_UV``, is checked too), with the
attention metadata built by each layer group's own metadata builder and a private KV cache of
just the blocks it needs (the engine's KV cache, and the requests paused in it, are not
touched). An engine that drafts (MTP) runs its drafter too (:func:`draft_logprobs`). Run where
no model step runs meanwhile: inside ``update_weights`` (the engine is paused for a blocking
refit) or ``finish_weight_update`` (paused for an overlapped refit's swap). Every worker of the
engine runs it at once (the tensor-parallel collectives of the forward), and every worker gets
the whole logits.

Supported: decoder models whose layers with forward-time state are vLLM's standard
``Attention`` or its ``MLAAttention`` (any backend with a metadata builder) and ``FusedMoE``;
on one pipeline stage; without LoRA. :func:`unsupported` says in one line why another engine
cannot run it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from ...errors import RefitError
from ...wire.protocol import Canary, token_mult_prob_error

__all__ = ["CanaryFailed", "unsupported", "engine_logprobs", "draft_logprobs", "check_canary"]


class CanaryFailed(RefitError):
    """The engine's logprobs on the new weights differ from the trainers' beyond the bound."""


def _forward_layers(vllm_config: Any) -> dict[str, Any]:
    return dict(vllm_config.compilation_config.static_forward_context)


def _attention_types() -> tuple[type, ...]:
    """The attention layers the canary builds metadata for: vLLM's standard ``Attention`` and
    its ``MLAAttention`` (DeepSeek's latent attention: one latent row per token in the cache)."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return (Attention, MLAAttention)


def unsupported(vllm_config: Any) -> str:
    """Why this engine cannot run the canary's forward ("" when it can)."""
    kinds = _attention_types()
    par = vllm_config.parallel_config
    if int(getattr(par, "pipeline_parallel_size", 1)) > 1:
        return "the canary's forward runs on one pipeline stage (this engine has pipeline_parallel_size > 1)"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "the canary's forward runs the base model, not a LoRA adapter (this engine serves LoRA)"
    for name, layer in _forward_layers(vllm_config).items():
        moe = "MoE" in type(layer).__name__  # FusedMoE / MoERunner: its forward needs no metadata
        if not (moe or type(layer) in kinds):
            return (f"layer {name} is a {type(layer).__name__} (the canary's forward builds metadata for "
                    f"standard and MLA attention only: Mamba and linear-attention layers are not supported)")
    return ""


def _blocks_dim(cache: torch.Tensor, vllm_config: Any) -> int:
    """Which dimension of a layer's KV cache counts its blocks (the backend's layout)."""
    blocks = getattr(vllm_config.cache_config, "num_gpu_blocks", None)
    for d, size in enumerate(cache.shape[:2]):
        if size == blocks:
            return d
    raise RefitError(f"canary: cannot tell the blocks dimension of a KV cache of shape {tuple(cache.shape)} "
                     f"({blocks} blocks)")


def _metadata(vllm_config: Any, device: torch.device, start: int, end: int,
              caches: dict[str, torch.Tensor] | None = None, reqs: int = 1) -> tuple[dict[str, Any],
                                                                                 dict[str, torch.Tensor],
                                                                                 dict[str, torch.Tensor]]:
    """``reqs`` requests, each of whose tokens ``[start, end)`` are computed now over a context
    of ``end`` (``start`` 0: a prefill; ``end - start`` 1 after a prefill: a decode step, which
    the backends run on their decode path), in one batch: every attention layer's metadata
    (built by its backend's own builder, one per group of layers with one KV cache spec), slot
    mapping, and a private KV cache holding just their blocks, request r's after request r-1's
    (``caches``: the prefill's, which the decode step reads)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    kinds = _attention_types()
    groups: dict[Any, list[str]] = {}
    layers = _forward_layers(vllm_config)
    for name, layer in layers.items():
        if type(layer) in kinds:
            spec = layer.get_kv_cache_spec(vllm_config)
            groups.setdefault((layer.attn_backend, spec), []).append(name)
    md: dict[str, Any] = {}
    slots: dict[str, torch.Tensor] = {}
    fresh = caches is None
    caches = {} if caches is None else caches
    q = end - start
    for (backend, spec), names in groups.items():
        bs = spec.block_size
        nb = (end + bs - 1) // bs  # blocks per request
        qsl = torch.arange(reqs + 1, dtype=torch.int32) * q
        # request r holds blocks [r * nb, (r + 1) * nb): position p's slot is r * nb * bs + p
        slots_of = torch.cat([torch.arange(start, end, dtype=torch.int64) + r * nb * bs for r in range(reqs)])
        common = CommonAttentionMetadata(
            query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
            seq_lens=torch.full((reqs,), end, dtype=torch.int32, device=device),
            num_reqs=reqs, num_actual_tokens=reqs * q, max_query_len=q, max_seq_len=end,
            block_table_tensor=torch.arange(reqs * nb, dtype=torch.int32, device=device).view(reqs, nb),
            slot_mapping=slots_of.to(device), causal=True,
            seq_lens_cpu_upper_bound=torch.full((reqs,), end, dtype=torch.int32),
            is_prefilling=torch.full((reqs,), start == 0, device=device))
        builder = backend.get_builder_cls()(spec, names, vllm_config, device)
        built = builder.build(0, common)
        for name in names:
            layer = layers[name]
            md[name], slots[name] = built, common.slot_mapping
            if fresh:
                live = layer.kv_cache
                shape = list(live.shape)
                shape[_blocks_dim(live, vllm_config)] = reqs * nb  # the backend's own layout, just these blocks
                caches[name] = torch.zeros(shape, dtype=live.dtype, device=live.device)
    return md, slots, caches


@torch.inference_mode()
def engine_logprobs(vllm_config: Any, model: torch.nn.Module, device: torch.device,
                    sequences: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                    hidden: list[torch.Tensor] | None = None) -> list[list[float]]:
    """The log-probability after each prefix of each sequence (``len(s) - 1`` values) of its
    target token (``Canary.scored``: the policy's likely tokens, or the sequence's own next
    ones, as vLLM's ``prompt_logprobs`` scores them), from ``model``'s current weights.

    The sequences of one length run as one batch of requests: one prefill of all their
    prefixes but the longest, then one **decode step** for those, reading the prefill's KV
    cache -- the state only decoding reads (MLA's absorbed ``W_UK``/``W_UV`` on vLLM's CPU and
    GPU MLA backends) is checked too. ``hidden``: each sequence's hidden states at the scored
    positions are appended to it (what a draft reads)."""
    from vllm.forward_context import set_forward_context

    layers = _forward_layers(vllm_config)
    out: dict[int, list[float]] = {}
    states_of: dict[int, torch.Tensor] = {}
    for n, batch in _by_length(sequences).items():  # n: the scored positions, each prefix's last token
        r = len(batch)
        caches, steps = None, []
        for start, end in ([(0, n)] if n < 2 else [(0, n - 1), (n - 1, n)]):
            md, slots, caches = _metadata(vllm_config, device, start, end, caches, reqs=r)
            steps.append((start, end, md, slots))
        logits, states = [], []
        with _private(layers, caches):  # every position is written before it is read
            for start, end, md, slots in steps:
                x = torch.tensor([int(t) for i in batch for t in sequences[i][start:end]], dtype=torch.long,
                                 device=device)
                pos = torch.arange(start, end, dtype=torch.long, device=device).repeat(r)
                with set_forward_context(md, vllm_config, num_tokens=r * (end - start), slot_mapping=slots):
                    h = model(input_ids=x, positions=pos)
                states.append(h.view(r, end - start, -1))
                logits.append(model.compute_logits(h).view(r, end - start, -1))
        logits_all, states_all = torch.cat(logits, dim=1), torch.cat(states, dim=1)
        for k, i in enumerate(batch):
            out[i] = _scored(logits_all[k], targets[i])
            states_of[i] = states_all[k]
    if hidden is not None:
        hidden.extend(states_of[i] for i in range(len(sequences)))
    return [out[i] for i in range(len(sequences))]


def _by_length(sequences: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """The indices of ``sequences`` by their scored positions (length - 1): each group runs
    as one batch of requests."""
    out: dict[int, list[int]] = {}
    for i, seq in enumerate(sequences):
        out.setdefault(len(seq) - 1, []).append(i)
    return out


@torch.inference_mode()
def draft_logprobs(vllm_config: Any, draft: torch.nn.Module, device: torch.device,
                   sequences: Sequence[Sequence[int]], hidden: Sequence[torch.Tensor],
                   targets: Sequence[Sequence[int]]) -> list[list[float]]:
    """The draft's log-probability (DeepSeek's MTP: ``forward(input_ids, positions,
    hidden_states)``) at each position i of each sequence but the last of its target there --
    the token two ahead -- given the target's hidden state at i (``hidden``, from
    :func:`engine_logprobs`) and token i+1. One prefill per sequence over the draft's own
    attention layers (their private KV cache). Positions start at 1: vLLM's MTP zeroes the input
    embedding at position 0, megatron's does not, and rotary attention depends only on relative
    positions, so the shifted positions give both frameworks' draft the same computation."""
    from vllm.forward_context import set_forward_context

    layers = _forward_layers(vllm_config)
    out: dict[int, list[float]] = {}
    for n, batch in _by_length(sequences).items():  # one batch of requests per length
        r = len(batch)
        md, slots, caches = _metadata(vllm_config, device, 0, n, reqs=r)
        with _private(layers, caches):
            x = torch.tensor([int(t) for i in batch for t in sequences[i][1:]], dtype=torch.long, device=device)
            pos = torch.arange(1, n + 1, dtype=torch.long, device=device).repeat(r)
            states = torch.cat([hidden[i][:n] for i in batch])
            with set_forward_context(md, vllm_config, num_tokens=r * n, slot_mapping=slots):
                h = draft(input_ids=x, positions=pos, hidden_states=states)
            logits = draft.compute_logits(h[0] if isinstance(h, tuple) else h).view(r, n, -1)
        for k, i in enumerate(batch):
            out[i] = _scored(logits[k], targets[i])
    return [out[i] for i in range(len(sequences))]


@contextlib.contextmanager
def _private(layers: dict[str, Any], caches: dict[str, torch.Tensor]) -> Iterator[None]:
    """While inside, each attention layer reads and writes its private (zeroed) KV cache; the
    engine's own caches are put back on the way out."""
    saved = {name: layers[name].kv_cache for name in caches}
    try:
        for name, cache in caches.items():
            cache.zero_()
            layers[name].kv_cache = cache
        yield
    finally:
        for name, cache in saved.items():
            layers[name].kv_cache = cache


def _scored(logits: torch.Tensor, targets: Sequence[int]) -> list[float]:
    """The fp32 log-probability of each target, one per row of ``logits``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor([int(t) for t in targets], dtype=torch.long, device=lp.device)
    return lp.gather(1, target[:, None])[:, 0].cpu().tolist()


def check_canary(canary: Canary, got: Sequence[Sequence[float]], who: str, draft: bool = False) -> list[float]:
    """The error of every canary sequence; raises ``CanaryFailed`` naming ``who`` (the engine),
    the worst canary, its error and the bound when one exceeds it. ``draft``: ``got`` is the
    draft's, checked against ``draft_reference``."""
    reference = canary.draft_reference if draft else canary.reference
    errors = [token_mult_prob_error(list(g), list(r)) for g, r in zip(got, reference)]
    worst = max(range(len(errors)), key=lambda i: errors[i])
    if not errors[worst] <= canary.bound:  # NaN fails too
        raise CanaryFailed(f"{who}: {'draft ' if draft else ''}canary {worst + 1} of {len(errors)} "
                           f"({len(canary.tokens[worst])} tokens): "
                           f"token_mult_prob_error {errors[worst]:.6f} > bound {canary.bound:g}"
                           f"{f' ({canary.dtype})' if canary.dtype else ''}: the new weights are not served")
    return errors
