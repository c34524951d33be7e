"""This project's training ranks, and the local job's group of them.

:class:`MegatronTrainerRank` is a ``ranks.TrainerRank`` with this project's policy (the
production stack: ``Float16Module``, megatron DDP, the distributed optimizer) and the training
calls. :class:`LocalTrainerGroup` runs them in spawned processes behind ``ranks.TrainerGroup``,
over queues; every wait has a timeout, and a dead rank is named. Refit bytes move only over
the refit group.
"""

from __future__ import annotations

import gc
import os
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..infra import procs
from ..adapters.megatron.rules import MegatronParallel
from ..infra.checkpoint import load_canonical
from ..errors import ConfigError, LayoutError, TrainerError
from ..layout import ModelSpec
from ..layout.lora import PeftConfig
from .losses import GrpoBatch, PgLossSettings, clipped_pg_loss
from .ranks import RankCall, TrainerGroup, TrainerRank

__all__ = ["TrainerSetup", "PolicyRank", "MegatronTrainerRank", "DTensorTrainerRank", "trainer_rank",
           "LocalTrainerGroup", "TrainerError"]

@dataclass(frozen=True)
class TrainerSetup:
    """How a job starts its megatron ranks (locally or as Ray actors): one value every rank
    builds its policy from."""

    spec: ModelSpec
    #: megatron-core's sizes, or a DTensor policy's mesh (``adapters.dtensor.DTensorParallel``)
    par: Any
    checkpoint: str  # HF checkpoint directory, loaded through the descriptors
    port: int  # megatron's own default group rendezvous
    #: Where rank 0 listens for that rendezvous (a Ray job: the first training bundle's node IP).
    host: str = "127.0.0.1"
    timeout_s: float = 300.0
    threads: int = 1
    #: ``TrainSettings`` fields (dtype, use_distributed_optimizer, lr, ...); dtype defaults to the spec's.
    train: dict = field(default_factory=dict)
    #: Force the distributed optimizer's parameter all-gather before a refit reads the weights.
    #: False only to show the hazard it prevents (tests): with ``overlap_param_gather`` the
    #: model weights are whole only after the next forward.
    sync_before_refit: bool = True
    #: A LoRA policy (``policy.megatron_cfg.peft``): adapters trained, base weights frozen.
    peft: PeftConfig | None = None
    #: megatron-core's MTP block too (the checkpoint's MTP layers: speculative decoding's draft).
    mtp: bool = False


class PolicyRank(TrainerRank):
    """A training rank of this project's jobs (a ``ranks.TrainerRank`` that trains): its policy
    (``self.policy``: ``train_step`` / ``logprobs`` / ``top_logprobs`` / ``local_params``) and the
    training calls the jobs need, written once for every backend: megatron-core
    (:class:`MegatronTrainerRank`) and a DTensor policy (:class:`DTensorTrainerRank`)."""

    policy: Any

    def __init__(self, endpoint: Any, sync_params: Callable[[], None] | None = None) -> None:
        super().__init__(endpoint, sync_params=sync_params)
        if endpoint.canary is None:  # a refit's deferred canary: the policy's likely tokens, after its last byte
            endpoint.canary = self._top_synced
        if endpoint.canary_draft is None and hasattr(self.policy, "draft_top_logprobs"):
            endpoint.canary_draft = self._draft_top_synced
        self.reference: dict[str, Any] | None = None  # frozen initial weights (GRPO's KL reference)
        #: Earlier policy versions' weights (async GRPO: a token's logprob under the version
        #: that generated it), by version.
        self.snapshots: dict[int, dict[str, Any]] = {}

    def _batch(self, token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """The batch as the policy takes it (every sequence, in order)."""
        return [list(t) for t in token_ids]

    def _images(self, token_ids: Sequence[Sequence[int]], images: Sequence[Any] | None) -> dict[str, Any]:
        """A vision-language policy's pixel values per sequence, repeated as :meth:`_batch`
        repeats the sequences (``{}``: a text-only batch)."""
        if images is None:
            return {}
        if len(images) != len(token_ids):
            raise ValueError(f"{len(images)} image entries for {len(token_ids)} sequences")
        return {"images": list(images) * (len(self._batch(token_ids)) // len(token_ids))}

    def train_step(self, token_ids: Sequence[Sequence[int]], lr: float | None = None,
                   images: Sequence[Any] | None = None) -> float:
        """One optimizer step of next-token cross-entropy (megatron's schedule, or the DTensor policy's);
        ``lr``: this step's learning rate instead of the configured one; ``images``: a
        vision-language policy's pixel values per sequence (``[n, 3, H, W]`` or None)."""
        return self.policy.train_step(self._batch(token_ids), lr=lr, **self._images(token_ids, images))

    def logprobs(self, token_ids: Sequence[Sequence[int]], version: int | None = None,
                 images: Sequence[Any] | None = None) -> list[list[float]]:
        """Next-token logprobs under the current weights (made whole first: the optimizer's
        parameter sync, as a refit reads them -- a forward that skips the gather would read a
        stale shard), or under the snapshot of ``version``."""
        self._sync()
        if version is not None:
            if version not in self.snapshots:
                raise KeyError(f"no snapshot of policy version {version} (held: {sorted(self.snapshots)})")
            return self._under(self.snapshots[version], token_ids, images)
        return self.policy.logprobs(self._batch(token_ids), **self._images(token_ids, images))[: len(token_ids)]

    def top_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[tuple[list[int], list[float]]]:
        """Per sequence: the most likely next token after each prefix and its log-prob, under the
        current weights (synced first, as :meth:`logprobs`)."""
        self._sync()
        return self._top_synced(token_ids)

    def _top_synced(self, token_ids: Sequence[Sequence[int]]) -> list[tuple[list[int], list[float]]]:
        """:meth:`top_logprobs` on weights already whole (inside a refit, which synced them)."""
        return self.policy.top_logprobs(self._batch(token_ids))[: len(token_ids)]

    def _draft_top_synced(self, token_ids: Sequence[Sequence[int]]) -> list[tuple[list[int], list[float]]]:
        """The MTP head's ``draft_top_logprobs`` on weights already whole (inside a refit)."""
        return self.policy.draft_top_logprobs(self._batch(token_ids))[: len(token_ids)]

    def snapshot(self, version: int, keep: Sequence[int]) -> int:
        """Keep a copy of the local weights as ``version``, drop versions not in ``keep``;
        returns the bytes the snapshots hold (host memory, beside the model)."""
        self.snapshots = {v: w for v, w in self.snapshots.items() if v in keep}
        if version in keep:
            self.snapshots[version] = {n: t.detach().clone() for n, t in self.policy.local_params().items()}
        return sum(t.numel() * t.element_size() for w in self.snapshots.values() for t in w.values())

    def _under(self, weights: dict[str, Any], token_ids: Sequence[Sequence[int]],
               images: Sequence[Any] | None = None) -> list[list[float]]:
        """Logprobs with ``weights`` swapped in, and the current weights back after."""
        import torch

        params = self.policy.local_params()
        current = {n: t.detach().clone() for n, t in params.items()}
        with torch.no_grad():
            for n, t in params.items():
                t.copy_(weights[n])
            try:
                return self.logprobs(token_ids, images=images)
            finally:
                for n, t in params.items():
                    t.copy_(current[n])

    def grpo_step(self, token_ids: Sequence[Sequence[int]], batch: GrpoBatch, loss: PgLossSettings,
                  images: Sequence[Any] | None = None) -> float:
        """One GRPO optimizer step: ``batch`` holds per sequence its advantage, the previous and
        reference logprobs and the completion mask; ``loss`` the clipping and KL settings."""
        n = len(token_ids)

        def loss_fn(lp, index):
            return clipped_pg_loss(lp, batch, index % n, loss)

        return self.policy.train_step(self._batch(token_ids), loss_fn, **self._images(token_ids, images))

    def reference_logprobs(self, token_ids: Sequence[Sequence[int]],
                           images: Sequence[Any] | None = None) -> list[list[float]]:
        """Logprobs under the frozen initial weights (kept at the first call: GRPO's reference
        policy), computed by swapping them in and the trained weights back."""
        if self.reference is None:
            self.reference = {n: t.detach().clone() for n, t in self.policy.local_params().items()}
        return self._under(self.reference, token_ids, images)

    def local_tensors(self) -> dict[str, Any]:
        """Copies of the synced local parameters (``verify=full`` gathers them)."""
        return {n: t.detach().clone() for n, t in self.synced_tensors().items()}

    def raw_bandwidth(self, pairs: Sequence[tuple[int, int]], nbytes: int, timeout_s: float) -> float | None:
        return self.endpoint.raw_bandwidth([tuple(p) for p in pairs], nbytes, timeout_s)


class MegatronTrainerRank(PolicyRank):
    """A training rank of this project's jobs (a ``ranks.TrainerRank`` that trains): a megatron-core
    :class:`~.adapters.megatron.train.Policy` built from the checkpoint, its endpoint, and the
    training calls the jobs need."""

    def __init__(self, rank: int, setup: TrainerSetup) -> None:
        import torch

        from ..adapters.megatron.build import init_megatron
        from ..adapters.megatron.endpoint import TrainerEndpoint
        from ..adapters.megatron.train import TrainSettings, build_policy

        torch.set_num_threads(setup.threads)
        self.setup = setup
        init_megatron(setup.par, rank, setup.par.world_size, setup.host, setup.port, setup.timeout_s)
        settings = TrainSettings(**{"dtype": setup.spec.dtype, **setup.train})
        self.policy = build_policy(setup.spec, setup.par, settings, peft=setup.peft, mtp=setup.mtp)
        self.policy.load_canonical(load_canonical(setup.checkpoint))
        sync = self.policy.sync_params if setup.sync_before_refit else (lambda: None)
        super().__init__(TrainerEndpoint(self.policy.chunks, setup.spec, rank=rank, sync_params=sync),
                         sync_params=self.policy.sync_params)

    def _batch(self, token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """Each data-parallel rank takes a share, and the interleaved (virtual) pipeline
        schedule needs a multiple of pp micro-batches:
        repeat the batch (the mean loss and every sequence's logprobs are unchanged)."""
        batch = [list(t) for t in token_ids]
        par = self.setup.par
        k = par.dp * (par.pp if par.vpp > 1 else 1)  # and each data-parallel rank one share
        reps = -(-k // len(batch)) if len(batch) % k else 1
        return batch * reps


class DTensorTrainerRank(PolicyRank):
    """A training rank of a DTensor policy (NeMo RL's DTensor backend: FSDP2 + TP over an HF
    model, ``adapters.dtensor.policy``): the same training calls, its end of the refit a
    ``DTensorEndpoint`` (each parameter's local shard, described from its placements)."""

    def __init__(self, rank: int, setup: TrainerSetup) -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from ..adapters.dtensor.policy import DTensorPolicy
        from ..adapters.dtensor.source import DTensorEndpoint

        torch.set_num_threads(setup.threads)
        self.setup = setup
        dist.init_process_group("gloo", init_method=f"tcp://{setup.host}:{setup.port}", rank=rank,
                                world_size=setup.par.world_size, timeout=timedelta(seconds=setup.timeout_s))
        known = {"lr", "weight_decay", "clip_grad", "seed"}
        unknown = sorted(set(setup.train) - known)
        if unknown:
            raise ConfigError(f"a DTensor policy's training settings are {sorted(known)}, not {unknown}")
        self.policy = DTensorPolicy(setup.spec, setup.par, setup.checkpoint, **setup.train)
        endpoint = DTensorEndpoint(self.policy.model, setup.spec, rank=rank)
        # what every read of the weights runs first: FSDP2's parameters back to their shards
        super().__init__(endpoint, sync_params=endpoint.reshard)


def trainer_rank(rank: int, setup: TrainerSetup) -> PolicyRank:
    """Rank ``rank`` of the policy ``setup`` describes: megatron-core's, or a DTensor policy's.

    What it has built by then (the imports, the model, its optimizer and the refit's layouts)
    lives as long as the rank: it leaves the garbage collector's view (``gc.freeze``), so the
    full collections a training step's allocations trigger walk only what the step made (the
    pauses Megatron's training loop turns its automatic collections off for: ``manual_gc``)."""
    from ..adapters.dtensor.parallel import DTensorParallel

    state: PolicyRank = (DTensorTrainerRank(rank, setup) if isinstance(setup.par, DTensorParallel)
                         else MegatronTrainerRank(rank, setup))
    gc.collect()
    gc.freeze()
    return state


@dataclass(frozen=True)
class _Command:
    seq: int
    call: RankCall[Any] | None  # None: stop


@dataclass(frozen=True)
class _Reply:
    """Every reply carries its command's sequence number, so a reply left over from a failed
    command can never be taken for the next one's."""

    rank: int
    seq: int
    ok: bool
    value: Any = None  # the call's typed reply, or the error with its traceback


def _rank_main(rank: int, setup: TrainerSetup, commands: Any, replies: Any) -> None:
    """Command loop of one training rank: run each typed call on this rank's ``MegatronTrainerRank``."""
    from ..adapters.megatron.runtime import quiet_cpu_notices

    quiet_cpu_notices()  # the job said it once (a rank the fork server made has no PYTHONWARNINGS of the job's)
    try:
        state = trainer_rank(rank, setup)
        replies.put(_Reply(rank, 0, True))
    except BaseException:  # noqa: BLE001 - reported to the driver with its traceback
        replies.put(_Reply(rank, 0, False, f"in start-up:\n{traceback.format_exc()}"))
        return
    while True:
        cmd: _Command = commands.get()
        if cmd.call is None:
            state.close()
            replies.put(_Reply(rank, cmd.seq, True))
            # Leave now, without the interpreter's teardown: there megatron's default gloo
            # group waits out its whole timeout (minutes) for a peer that died.
            replies.close()
            replies.join_thread()
            os._exit(0)
        try:
            replies.put(_Reply(rank, cmd.seq, True, cmd.call.run(state)))
        except (LayoutError, ConfigError) as exc:  # bad input: its one line, not a traceback
            replies.put(_Reply(rank, cmd.seq, False, f"in {cmd.call.what!r}: {exc}"))
        except BaseException:  # noqa: BLE001
            replies.put(_Reply(rank, cmd.seq, False, f"in {cmd.call.what!r}:\n{traceback.format_exc()}"))


class LocalTrainerGroup(TrainerGroup):
    """``world`` megatron ranks in spawned processes: the rank protocol (``ranks.TrainerGroup``)
    over local queues.

    The queues are local IPC between this process and the ranks it spawned (the refit group's
    control plane is separate and authenticated)."""

    def __init__(self, setup: TrainerSetup) -> None:
        import torch.multiprocessing  # noqa: F401 - torch's tensor reductions on the queues

        self.setup = setup
        self.world_size = setup.par.world_size
        self.timeout_s = setup.timeout_s
        # Spawned (or, with MCORE_RESHARD_FAST_START=1, forked by the fork server that
        # imported torch and megatron-core once: procs.py).
        ctx = procs.process_context("spawn")
        self._replies = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(self.world_size)]
        self.procs = [ctx.Process(target=_rank_main, args=(r, setup, self._commands[r], self._replies), daemon=True)
                      for r in range(self.world_size)]
        for p in self.procs:
            p.start()
        self._seq = 0
        try:
            self._collect("start-up", 0, setup.timeout_s)
        except BaseException:
            self.close()  # never leave half a pool running
            raise

    def _send(self, what: str, calls: Sequence[RankCall[Any]]) -> Callable[[float, bool], list[Any]]:
        self._seq += 1
        seq = self._seq
        for q, call in zip(self._commands, calls, strict=True):
            q.put(_Command(seq, call))
        return lambda timeout_s, every: self._collect(what, seq, timeout_s, every)

    def _collect(self, what: str, seq: int, timeout_s: float, every: bool = False) -> list[Any]:
        out: dict[int, Any] = {}
        failed: dict[int, str] = {}  # rank -> its failure, in the order they came
        deadline = time.monotonic() + timeout_s
        while len(out) + len(failed) < self.world_size and not (failed and not every):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world_size)) - set(out) - set(failed))
                if failed:
                    break  # the first failure is the error; the late ranks are named with it
                raise TrainerError(f"training rank(s) {missing} did not finish {what!r} within {timeout_s:.0f}s")
            try:
                reply: _Reply = self._replies.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                for r, p in enumerate(self.procs):
                    if r not in out and r not in failed and not p.is_alive():
                        failed[r] = f"training rank {r} died (exit code {p.exitcode}) during {what!r}"
                continue
            if reply.seq != seq:
                continue  # a reply to an earlier command that failed elsewhere first
            if not reply.ok:
                failed[reply.rank] = f"training rank {reply.rank} failed {reply.value}"
                continue
            out[reply.rank] = reply.value
        if failed:
            raise TrainerError(next(iter(failed.values())))
        return [out[r] for r in range(self.world_size)]

    def dead(self) -> list[str]:
        """One line per rank whose process is gone (named in a failed refit's error)."""
        return [f"training rank {r} died (exit code {p.exitcode})" for r, p in enumerate(self.procs)
                if not p.is_alive()]

    def kill(self, rank: int) -> None:
        """Kill one rank (failure tests)."""
        self.procs[rank].kill()

    def close(self) -> None:
        for r, q in enumerate(self._commands):
            if self.procs[r].is_alive():
                q.put(_Command(-1, None))
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
