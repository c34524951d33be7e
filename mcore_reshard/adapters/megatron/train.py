"""The production training stack on megatron-core, as Megatron-LM / NeMo RL build it.

``build_policy`` (after :func:`~.build.init_megatron`) builds one ``GPTModel`` per virtual
pipeline stage, wraps each in megatron-core's ``Float16Module`` (bf16 only) and
``DistributedDataParallel`` (``DistributedDataParallelConfig`` as NeMo RL sets it:
``overlap_grad_reduce``, ``overlap_param_gather``, ``use_distributed_optimizer``,
``average_in_collective``), and builds the optimizer with ``get_megatron_optimizer``
(``OptimizerConfig(optimizer="adam", bf16=..., use_distributed_optimizer=...)``). Training and
log-probabilities go through megatron-core's own pipeline schedule
(``get_forward_backward_func()``: no pipelining, 1F1B, or interleaved for virtual stages), with
``finalize_model_grads`` as the gradient finaliser (DP reduce-scatter / all-reduce, q/k
layernorm grads summed over TP, embedding grads).

On CPU the CUDA-only calls on this path are patched in :mod:`.runtime` (one module, listed there).

Losses and log-probabilities are computed on the last pipeline stage from vocab-parallel logits
(``vocab_parallel_cross_entropy``: no TP gather), with the padded vocab rows masked out, and
then shared with every rank of the world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ...infra.optim import learning_rate
from ...layout import LocalParam, ModelSpec
from .rules import MegatronParallel

if TYPE_CHECKING:
    import torch

    from ...layout.lora import PeftConfig

__all__ = [
    "TrainSettings",
    "Policy",
    "build_policy",
    "forward_logits",
    "LossFn",
]

#: ``loss_fn(logprobs, index_of_sequence) -> scalar``: ``logprobs`` is ``Tensor[T-1]`` (fp32,
#: requires grad) of log p(token_i | tokens_<i), i >= 1, for the sequence ``index_of_sequence``
#: of the batch given to :meth:`Policy.train_step`. The step minimises the mean over sequences.
LossFn = Callable[["torch.Tensor", int], "torch.Tensor"]


@dataclass(frozen=True)
class TrainSettings:
    """How the trainer is built (defaults: NeMo RL's Megatron policy settings)."""

    dtype: str = "bfloat16"  # "bfloat16" (Float16Module, fp32 main params) | "float32"
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True  # needs use_distributed_optimizer
    average_in_collective: bool = True
    grad_reduce_in_fp32: bool = False
    lr: float = 1e-3
    weight_decay: float = 0.0
    clip_grad: float = 1.0  # 0: no clipping
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 1234
    #: A vision-language policy's frozen parts (``LLaVAModel.freeze``): the tower, the projector.
    freeze_vision_model: bool = False
    freeze_vision_projection: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float32', not {self.dtype!r}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlap_param_gather needs use_distributed_optimizer")


def forward_logits(model, tokens: "torch.Tensor", vocab: int) -> "torch.Tensor":
    """Single-stage megatron forward: logits ``[b, s, vocab]`` gathered over TP, padding dropped.

    ``model`` may be a bare ``GPTModel`` or wrapped (``Float16Module``, DDP). No pipeline: use
    :meth:`Policy.logprobs` for PP > 1.
    """
    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    pos = torch.arange(tokens.shape[1])[None]
    out = model(tokens, pos, attention_mask=None)
    return gather_from_tensor_model_parallel_region(out)[..., :vocab]


def _top_logprobs(logits: "torch.Tensor", vocab: int) -> "torch.Tensor":
    """``[b, 2, s-1]`` of ``b`` sequences' vocab-parallel logits ``[b, s, V/tp]``: the most
    likely next token after each prefix (row 0, as float) and its fp32 log-prob over the real
    vocab (row 1). The logits are gathered over TP: a canary's few positions, not a batch's."""
    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(logits[:, :-1].contiguous())[..., :vocab].float()
    best, token = torch.log_softmax(full, dim=-1).max(dim=-1)
    return torch.stack([token.float(), best], dim=1)


def _masked_vocab_parallel_logits(logits: "torch.Tensor", vocab: int) -> "torch.Tensor":
    """fp32 vocab-parallel logits with the padded vocab columns (global index >= vocab) at -inf."""
    import torch
    from megatron.core import parallel_state as ps

    logits = logits.float()
    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if start + local <= vocab:
        return logits
    keep = torch.arange(start, start + local) < vocab
    return logits.masked_fill(~keep, float("-inf"))


def _target_logprobs(logits: "torch.Tensor", tokens: "torch.Tensor", vocab: int) -> "torch.Tensor":
    """log p(tokens[:, i] | tokens[:, :i]) for i >= 1 from vocab-parallel logits ``[b, s, V/tp]``:
    ``[b, s-1]`` fp32, differentiable, summed over TP by megatron's vocab-parallel CE."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    masked = _masked_vocab_parallel_logits(logits[:, :-1], vocab)
    return -vocab_parallel_cross_entropy(masked.contiguous(), tokens[:, 1:].contiguous())


def _device() -> "torch.device":
    """This rank's device: its GPU, or the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class Policy:
    """A megatron-core policy on this rank: wrapped model chunks, the megatron optimizer, config.

    ``chunks`` are the DDP-wrapped chunks (one per virtual pipeline stage, as Megatron-LM keeps
    them); ``optimizer`` is the ``MegatronOptimizer`` (distributed / chained for MoE);
    ``config`` the ``TransformerConfig``. Every method is collective over the world.
    """

    def __init__(self, spec: ModelSpec, par: MegatronParallel, settings: TrainSettings, chunks: list,
                 optimizer, config) -> None:
        self.spec, self.par, self.settings = spec, par, settings
        self.chunks = chunks
        self.optimizer = optimizer
        self.config = config
        self._descs: list[LocalParam] | None = None

    # -- weights -----------------------------------------------------------------------------
    def local_params(self) -> dict[str, "torch.Tensor"]:
        """This rank's parameters by the names :func:`.live.describe` uses (wrappers stripped).

        With the distributed optimizer and overlapped param gather they are only whole after
        :meth:`sync_params` (or the next forward)."""
        from .live import named_local_params

        return named_local_params(self.chunks)

    def describe(self) -> list[LocalParam]:
        """Descriptors of this rank's parameters (cached; the layout never changes)."""
        from .live import describe

        if self._descs is None:
            self._descs = describe(self.chunks, self.spec)
        return self._descs

    def load_canonical(self, tensors: dict[str, "torch.Tensor"]) -> None:
        """Write HF tensors into the model params through the descriptors (padding rows zero),
        then reload the optimizer's fp32 main params from them. A LoRA policy's adapters that
        ``tensors`` does not hold (an HF checkpoint without a PEFT adapter) keep their
        initialisation."""
        import torch

        from ...layout.lora import is_adapter_tensor
        from ...transport.views import write_pieces

        params = self.local_params()
        with torch.no_grad():
            for lp in self.describe():
                if any(is_adapter_tensor(q.canonical) and q.canonical not in tensors for q in lp.pieces):
                    continue
                t = params[lp.name].data
                t.zero_()
                write_pieces(t, lp.pieces, tensors)
            if self.spec.tied and self.par.pp > 1:
                # The last stage's output_layer is a copy of the first stage's embedding.
                for name, p in params.items():
                    if name.endswith("output_layer.weight"):
                        _write_tied_output(p, self.spec, tensors)
        if self.par.fsdp:  # reload_model_params refuses Megatron-FSDP: its own copy
            from .fsdp import copy_model_to_main

            for chunk in self.chunks:
                copy_model_to_main(chunk)
        else:
            self.optimizer.reload_model_params()

    def sync_params(self) -> None:
        """Make the model weights whole (call before a refit reads them).

        With the distributed optimizer each DP rank updates only its own shard of the bf16 /
        fp32 model params in ``optimizer.step()``; with ``overlap_param_gather`` the all-gather
        of the others' shards is left to the next forward's pre-hooks. This forces it now
        (``DistributedDataParallel.start_param_sync(force_sync=True)`` per chunk: waits for an
        in-flight gather or runs a synchronous one). The next forward then does not gather again.
        Without ``overlap_param_gather`` the step itself gathers, and this is a no-op.
        """
        import torch

        if self.par.fsdp:  # a refit reads this rank's slices, which the step wrote
            return
        if not (self.settings.use_distributed_optimizer and self.settings.overlap_param_gather):
            return
        with torch.no_grad():
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)

    # -- schedule ------------------------------------------------------------------------------
    def _dp_slice(self, token_ids: Sequence[Sequence[int]]) -> list[tuple[int, list[int]]]:
        from megatron.core import parallel_state as ps

        dp = ps.get_data_parallel_world_size()
        if not token_ids:
            raise ValueError("no sequences")
        if len(token_ids) % dp:
            raise ValueError(f"{len(token_ids)} sequences do not split over data-parallel size {dp}")
        lengths = {len(t) for t in token_ids}
        if len(lengths) != 1 or min(lengths) < 2:
            raise ValueError(f"sequences must have one common length >= 2, got lengths {sorted(lengths)}")
        r = ps.get_data_parallel_rank()
        return [(i, list(token_ids[i])) for i in range(r, len(token_ids), dp)]

    def _run_schedule(self, mine: list[tuple[int, list[int]]], forward_only: bool, per_seq, measure=None,
                      images: Sequence[Any] | None = None, together: bool = False):
        """Run megatron's schedule over ``mine`` (one sequence per micro-batch; ``together``:
        all of them as one micro-batch, for a forward-only measure of a few short sequences --
        the canary's -- where each micro-batch's fixed cost is most of its time). ``per_seq(lp,
        index)`` maps the ``[T-1]`` target log-probs of a sequence (or its row of what
        ``measure(logits, tokens)`` makes of the batch's output instead) to ``(loss,
        payload)``. Returns the payloads this rank computed (last stage only) by sequence index.
        ``images``: a vision-language policy's pixel values per sequence (``[n, 3, H, W]`` or
        None), by sequence index."""
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func

        spec = self.spec
        if images is not None and spec.vision is None:
            raise ValueError(f"images given to a {spec.family.title} policy, which has no vision tower")
        if together and (images is not None or not forward_only):
            raise ValueError("sequences run together for a forward-only measure without images only")
        groups = [mine] if together else [[one] for one in mine]
        batches = [{"index": [i for i, _ in g], "tokens": torch.tensor([t for _, t in g], dtype=torch.long),
                    "images": None if images is None else images[g[0][0]]} for g in groups]
        seq_len = len(mine[0][1])

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            x = b["tokens"]
            if spec.vision is not None:  # LLaVA: the tower's embeddings spliced in at the placeholders
                from .vlm import llava_forward

                out = llava_forward(model, x, b["images"], spec)
            else:
                pos = torch.arange(x.shape[1])[None]
                out = model(x, pos, attention_mask=None)

            def loss_func(output_tensor):
                rows = _target_logprobs(output_tensor, x, spec.vocab) if measure is None else measure(output_tensor, x)
                done = [per_seq(rows[k], i) for k, i in enumerate(b["index"])]
                loss = sum(d[0] for d in done)
                return loss, {"index": b["index"], "loss": [d[0].detach().clone() for d in done],
                              "payload": [d[1] for d in done]}

            return out, loss_func

        iters = [iter(batches) for _ in self.chunks] if len(self.chunks) > 1 else iter(batches)
        train_mode = not forward_only and self._train_mode_allowed()
        for chunk in self.chunks:
            chunk.train(train_mode)
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iters,
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=len(batches),
            seq_length=seq_len,
            micro_batch_size=len(groups[0]),
            forward_only=forward_only,
        )
        return {i: {"index": i, "loss": loss, "payload": payload} for d in (out or [])
                for i, loss, payload in zip(d["index"], d["loss"], d["payload"])}

    def _train_mode_allowed(self) -> bool:
        """Train steps run the chunks in train mode, except MoE with TP > 1 and no sequence
        parallelism: megatron's ``MoELayer.forward`` refuses that in train mode ("During
        training, performance may degrade if MoE and tensor parallelism are enabled without also
        enabling sequence parallelism"), and sequence parallelism needs a fused (Apex / TE, GPU)
        norm ("sequence parallel not supported by torch LayerNorm"). Those steps run in eval
        mode: dropout is 0 and the router has no train-only behaviour here (no aux loss, no
        jitter, no token dropping), so the loss and its gradients are the same."""
        cfg = self.config
        return not (cfg.num_moe_experts and cfg.tensor_model_parallel_size > 1 and not cfg.sequence_parallel)

    def train_step(self, token_ids: Sequence[Sequence[int]], loss_fn: LossFn | None = None,
                   lr: float | None = None, images: Sequence[Any] | None = None) -> float:
        """One optimizer step on ``token_ids`` (the global batch: sequence i goes to data-parallel
        rank ``i % dp``; one sequence per micro-batch; equal lengths). Default loss: next-token
        cross-entropy averaged over positions. ``lr``: this step's learning rate instead of the
        configured one (e.g. 0: a step that changes no weight). Returns the mean loss over the
        batch, on every rank."""
        import torch

        mine = self._dp_slice(token_ids)

        def per_seq(lp, index):
            loss = -lp.mean() if loss_fn is None else loss_fn(lp, index)
            return loss, None

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        res = self._run_schedule(mine, forward_only=False, per_seq=per_seq, images=images)
        with learning_rate(self.optimizer, lr):
            update_ok, _grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise RuntimeError("megatron optimizer skipped the step (non-finite gradients)")
        total = torch.tensor([sum(float(d["loss"]) for d in res.values()), float(len(res))], dtype=torch.float64)
        torch.distributed.all_reduce(total)  # last-stage ranks only contribute; TP copies cancel out
        return float(total[0] / total[1])

    def logprobs(self, token_ids: Sequence[Sequence[int]], images: Sequence[Any] | None = None) -> list[list[float]]:
        """log p(token_i | tokens_<i) for i >= 1 of every sequence (fp32 log-softmax over the real
        vocab), forward only through the schedule; the same lists on every rank."""
        return self._forward_payloads(token_ids, images=images)

    def top_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[tuple[list[int], list[float]]]:
        """Per sequence: the most likely token after each prefix ``tokens_<=i`` (i < T-1) and its
        log-prob (fp32 log-softmax over the real vocab): the likely tokens a refit's canary scores
        (``refit.canary``). Forward only; the same lists on every rank."""
        vocab = self.spec.vocab
        out = self._forward_payloads(token_ids, lambda logits, x: _top_logprobs(logits, vocab), together=True)
        return [([int(t) for t in tok], lp) for tok, lp in out]

    def draft_top_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[tuple[list[int], list[float]]]:
        """Per sequence, what the MTP draft predicts at each position i but the last: the token
        two ahead it finds most likely (given the target's hidden state at i and token i+1) and
        its fp32 log-prob -- megatron's first MTP layer through the shared output layer, as its
        training loss reads it (a refit's draft canary). Forward only, collective over the
        world; the same lists on every rank; empty lists on a policy without MTP."""
        import torch

        from .live import _unwrap

        if not self.config.mtp_num_layers:
            return [([], []) for _ in token_ids]
        # the MTP block lives on the last pipeline stage; every rank runs the schedule
        heads = [m for m in (_unwrap(c) for c in self.chunks) if getattr(m, "mtp", None) is not None]
        captured: list = []
        hooks = [h.mtp.register_forward_hook(lambda _m, _i, out: captured.append(out)) for h in heads[-1:]]

        def measure(_logits, _x):  # on the last stage only, where the MTP block ran
            head = heads[-1]
            hidden = torch.chunk(captured.pop(), 1 + self.config.mtp_num_layers, dim=0)[1]
            weight = head.shared_embedding_or_output_weight() if head.share_embeddings_and_output_weights else None
            logits, _ = head.output_layer(hidden, weight=weight)
            # [s, 1, V/tp] -> [1, s, V/tp]; the last position's input token is rolled in from
            # the front (no token i+1): _top_logprobs drops it
            return _top_logprobs(logits.transpose(0, 1), self.spec.vocab)

        try:
            out = self._forward_payloads(token_ids, measure, together=True)
        finally:
            for hook in hooks:
                hook.remove()
        return [([int(t) for t in tok], lp) for tok, lp in out]

    def _forward_payloads(self, token_ids: Sequence[Sequence[int]], measure=None,
                          images: Sequence[Any] | None = None, together: bool = False) -> list[Any]:
        """Every sequence's forward-only result (``_run_schedule``'s ``measure``; default: its
        target log-probs) as lists, gathered to every rank (``together``: this rank's sequences
        as one micro-batch)."""
        import torch
        from megatron.core import parallel_state as ps

        mine = self._dp_slice(token_ids)

        def per_seq(lp, index):
            return lp.sum() * 0.0, lp.detach().tolist()

        with torch.no_grad():
            res = self._run_schedule(mine, forward_only=True, per_seq=per_seq, measure=measure, images=images,
                                     together=together)
        local = {i: d["payload"] for i, d in res.items()} if ps.get_tensor_model_parallel_rank() == 0 else {}
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, local)
        merged: dict[int, list[float]] = {}
        for g in gathered:
            merged.update(g)
        missing = [i for i in range(len(token_ids)) if i not in merged]
        if missing:
            raise RuntimeError(f"no rank returned log-probs for sequences {missing}")
        return [merged[i] for i in range(len(token_ids))]


def _write_tied_output(p, spec: ModelSpec, tensors) -> None:
    """Copy this TP rank's rows of the HF embedding into a tied last-stage output layer."""
    from megatron.core import parallel_state as ps

    emb = tensors["model.embed_tokens.weight"]
    rows = p.shape[0]
    start = ps.get_tensor_model_parallel_rank() * rows
    n = max(0, min(rows, spec.vocab - start))
    p.data.zero_()
    if n:
        p.data[:n].copy_(emb[start:start + n])


def build_policy(spec: ModelSpec, par: MegatronParallel, settings: TrainSettings = TrainSettings(),
                 max_seq: int = 512, peft: "PeftConfig | None" = None, mtp: bool = False) -> Policy:
    """Build the policy on this rank (call after :func:`.build.init_megatron`; collective).

    Megatron-LM's ``get_model`` + ``setup_model_and_optimizer``: ``GPTModel`` (a hybrid
    family's ``HybridModel``, ``hybrid_build``) chunks in
    ``settings.dtype`` -> ``Float16Module`` (bf16) -> ``DistributedDataParallel`` (bucketing
    only on the first chunk) -> ``broadcast_params`` -> ``get_megatron_optimizer``; the schedule
    hooks (``grad_scale_func``, ``no_sync_func``, ``grad_sync_func``,
    ``finalize_model_grads_func``) are set on the config as Megatron-LM's ``train`` sets them.

    ``peft``: a LoRA policy (``lora.add_lora``): adapters added to the bare chunks and every
    base weight frozen, so DDP's buckets and the (distributed) optimizer hold the adapters only.
    ``mtp``: megatron-core's MTP block too (``build.build_gpt``): the draft speculative decoding
    runs, trained and refit with the model.
    """
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, \
        finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from .build import build_gpt
    from .hybrid_build import build_hybrid
    from .runtime import apply_cpu_patches

    if par.fsdp and (mtp or (peft is not None and peft.enabled)):
        raise ValueError("Megatron-FSDP policies are built without LoRA adapters or an MTP block")
    apply_cpu_patches()
    torch.manual_seed(settings.seed)
    model_parallel_cuda_manual_seed(settings.seed, force_reset_rng=True)
    bf16 = settings.dtype == "bfloat16"
    if spec.vision is not None:  # LLaVA: megatron-core's LLaVAModel (``vlm``)
        if mtp or (peft is not None and peft.enabled) or par.fsdp:
            raise ValueError(f"{spec.family.title}: MTP, LoRA and Megatron-FSDP policies of a vision-language "
                             f"family are not built")
        from .vlm import build_llava

        raw = build_llava(spec, par, dtype=settings.dtype, max_seq=max_seq)
        raw[0].freeze(freeze_language_model=False, freeze_vision_model=settings.freeze_vision_model,
                      freeze_vision_projection=settings.freeze_vision_projection)
    elif spec.hybrid is not None:  # Nemotron-H, Qwen3-Next: megatron-core's HybridModel
        if mtp or (peft is not None and peft.enabled):
            raise ValueError(f"{spec.family.title}: MTP and LoRA policies of a hybrid family are not built")
        raw = build_hybrid(spec, par, dtype=settings.dtype, max_seq=max_seq)
    else:
        raw = build_gpt(spec, par, dtype=settings.dtype, max_seq=max_seq, mtp=mtp)
    config = raw[0].config
    if peft is not None and peft.enabled:
        from .lora import add_lora

        add_lora(raw, spec, peft)
    # Megatron-FSDP folds the 1/dp gradient scale into NCCL's PREMUL_SUM, which gloo lacks: on
    # the CPU the gradient is scaled, then summed (its own unfused path).
    fsdp = {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params",
            "gradient_reduce_div_fusion": torch.cuda.is_available()} if par.fsdp else {}
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=settings.grad_reduce_in_fp32,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        overlap_param_gather=settings.overlap_param_gather,
        # Megatron-FSDP reads the expert data-parallel group's size for it, which a dense model
        # has not: the same mean, scaled before the reduction instead.
        average_in_collective=settings.average_in_collective and not par.fsdp,
        use_distributed_optimizer=settings.use_distributed_optimizer or par.fsdp,
        check_for_nan_in_grad=True,
        **fsdp,
    )
    chunks = []
    for i, m in enumerate(raw):
        if bf16:
            m = Float16Module(config, m)
        if par.fsdp:  # Megatron-LM's get_model: the FSDP wrapper in place of DDP
            from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

            from .runtime import apply_fsdp_cpu_patches

            apply_fsdp_cpu_patches()
            chunks.append(FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=m,
                                                   disable_bucketing=i > 0, device=_device()))
            continue
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=m,
                                              disable_bucketing=i > 0))
        chunks[-1].broadcast_params()
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=bf16,
        params_dtype=torch.float32,
        use_distributed_optimizer=settings.use_distributed_optimizer or par.fsdp,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    config.grad_scale_func = optimizer.scale_loss
    if settings.overlap_grad_reduce:
        syncs = [c.no_sync for c in chunks]
        config.no_sync_func = syncs[0] if len(chunks) == 1 else syncs
        grads = [c.start_grad_sync for c in chunks]
        config.grad_sync_func = grads[0] if len(chunks) == 1 else grads
    config.finalize_model_grads_func = finalize_model_grads
    return Policy(spec, par, settings, chunks, optimizer, config)
