"""Training ranks of the local refit job: megatron-core ranks in spawned processes, each
holding a :class:`~.adapters.megatron.train.Policy` (the production stack: ``Float16Module``,
megatron DDP, the distributed optimizer) and a :class:`TrainerEndpoint`.

This is one driver's way of running trainer endpoints (a framework runs them in its own
processes, e.g. Ray actors). The driver talks to every rank over queues with typed protocol
messages; every wait has a timeout, and a dead rank is named. Refit bytes move only over the
refit group.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

from .adapters.megatron.rules import MegatronParallel
from .errors import TrainerError
from .layout import ModelSpec
from .protocol import JoinInfo, RefitRequest

__all__ = ["TrainerSetup", "TrainerPool", "TrainerError"]


@dataclass(frozen=True)
class TrainerSetup:
    spec: ModelSpec
    par: MegatronParallel
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


class _Rank:
    """The state a training rank keeps between commands: its policy and its endpoint."""

    def __init__(self, rank: int, setup: TrainerSetup) -> None:
        import torch

        from .adapters.megatron.build import init_megatron
        from .adapters.megatron.endpoint import TrainerEndpoint
        from .adapters.megatron.train import TrainSettings, build_policy
        from .checkpoint import load_canonical

        torch.set_num_threads(setup.threads)
        self.rank, self.setup, self.spec = rank, setup, setup.spec
        init_megatron(setup.par, rank, setup.par.world_size, setup.host, setup.port, setup.timeout_s)
        settings = TrainSettings(**{"dtype": self.spec.dtype, **setup.train})
        self.policy = build_policy(self.spec, setup.par, settings)
        self.policy.load_canonical(load_canonical(setup.checkpoint))
        sync = self.policy.sync_params if setup.sync_before_refit else (lambda: None)
        self.endpoint = TrainerEndpoint(self.policy.chunks, self.spec, rank=rank, sync_params=sync)
        self.hf_group = None
        self.reference: dict[str, Any] | None = None  # frozen initial weights (GRPO's KL reference)

    # -- the refit protocol (trainer endpoint) -----------------------------------------------
    def describe(self):
        return self.endpoint.describe()

    def join(self, info: JoinInfo) -> int:
        return self.endpoint.join(info)

    def set_plan(self, slice_wire: dict, digest: str) -> str:
        return self.endpoint.set_plan(slice_wire, digest)

    def refit(self, request: RefitRequest, progress: bool = False, fault: Any = None):
        """This rank's report, plus every rank's (from the vote) on rank 0."""
        report = self.endpoint.refit(request, progress=progress and self.rank == 0, fault=fault)
        return report, (self.endpoint.last_reports if self.rank == 0 else None)

    def refit_with_fault(self, request: RefitRequest, fault_rank: int, fault: Any):
        """Fault injection: like :meth:`refit`, with ``fault`` (``transport.executor.Fault``,
        e.g. one bit flipped in flight) on training rank ``fault_rank`` only."""
        return self.refit(request, fault=fault if self.rank == fault_rank else None)

    def refit_and_die(self, request: RefitRequest, die_rank: int, after_reads: int):
        """Fault injection (tests, ``scripts/soak.py``): like :meth:`refit`, but rank
        ``die_rank`` exits abruptly after its packer has read ``after_reads`` source tensors --
        a trainer dying mid-refit."""
        if self.rank == die_rank:
            tensors = _DieAfter(self.endpoint.local_tensors(), after_reads, os._exit)
            self.endpoint.local_tensors = lambda: tensors  # this rank's next read goes through it
        return self.refit(request)

    def leave(self) -> None:
        self.endpoint.leave()

    # -- training ------------------------------------------------------------------------
    def _batch(self, token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """Each data-parallel rank takes a share, and the interleaved (virtual) pipeline
        schedule needs a multiple of pp micro-batches:
        repeat the batch (the mean loss and every sequence's logprobs are unchanged)."""
        batch = [list(t) for t in token_ids]
        par = self.setup.par
        k = par.dp * (par.pp if par.vpp > 1 else 1)  # and each data-parallel rank one share
        reps = -(-k // len(batch)) if len(batch) % k else 1
        return batch * reps

    def step(self, token_ids: Sequence[Sequence[int]]) -> float:
        """One optimizer step of next-token cross-entropy (through megatron's schedule)."""
        return self.policy.train_step(self._batch(token_ids))

    def logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        return self.policy.logprobs(self._batch(token_ids))[: len(token_ids)]

    def grpo_step(self, token_ids: Sequence[Sequence[int]], batch: Any, loss: Any) -> float:
        """One GRPO optimizer step: ``batch`` (``grpo.algorithm.GrpoBatch``) holds per sequence
        its advantage, the previous and reference logprobs and the completion mask; ``loss``
        (``grpo.recipe.LossSettings``) the clipping and KL settings."""
        from .grpo.algorithm import clipped_pg_loss

        n = len(token_ids)

        def loss_fn(lp, index):
            return clipped_pg_loss(lp, batch, index % n, loss)

        return self.policy.train_step(self._batch(token_ids), loss_fn)

    def reference_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprobs under the frozen initial weights (kept at the first call: GRPO's reference
        policy), computed by swapping them in and the trained weights back."""
        import torch

        params = self.policy.local_params()
        if self.reference is None:
            self.reference = {n: t.detach().clone() for n, t in params.items()}
        trained = {n: t.detach().clone() for n, t in params.items()}
        with torch.no_grad():
            for n, t in params.items():
                t.copy_(self.reference[n])
            try:
                return self.logprobs(token_ids)
            finally:
                for n, t in params.items():
                    t.copy_(trained[n])

    def local_tensors(self) -> dict[str, Any]:
        """Copies of the synced local parameters (``verify=full`` gathers them)."""
        self.policy.sync_params()
        return {n: t.detach().clone() for n, t in self.endpoint.local_tensors().items()}

    # -- baseline and diagnostics ---------------------------------------------------------
    def hf_join(self, host: str, port: int, world: int, timeout_s: float, secret: str) -> None:
        """Baseline broadcast group: training rank 0 (root) and every vLLM worker."""
        from .hf_broadcast import HF_PREFIX
        from .transport.group import RefitGroup

        if self.rank == 0:
            if self.hf_group is not None:
                self.hf_group.close(barrier=False)
            self.hf_group = RefitGroup.create(host, port, 0, world, timeout_s, is_master=True, prefix=HF_PREFIX,
                                              secret=secret)

    def hf_send(self, gather_plan, buffer_bytes: int, timeout_s: float) -> dict:
        from .hf_broadcast import hf_send

        self.policy.sync_params()
        return hf_send(gather_plan, self.rank, self.setup.par.world_size, self.endpoint.local_tensors(),
                       self.spec.tensor_table(), self.endpoint.group, self.hf_group, buffer_bytes=buffer_bytes,
                       timeout_s=timeout_s)

    def raw_bandwidth(self, pairs: list[tuple[int, int]], nbytes: int, timeout_s: float) -> float | None:
        return self.endpoint.raw_bandwidth(pairs, nbytes, timeout_s)

    def close(self) -> None:
        self.endpoint.leave()
        if self.hf_group is not None:
            self.hf_group.close(barrier=False)
            self.hf_group = None


class _DieAfter(dict):
    """A tensor mapping whose owner process exits at the n-th lookup (fault injection)."""

    def __init__(self, tensors, n: int, exit_fn) -> None:
        super().__init__(tensors)
        self._left, self._exit = n, exit_fn

    def __getitem__(self, key):
        self._left -= 1
        if self._left < 0:
            self._exit(17)
        return super().__getitem__(key)


def _rank_main(rank: int, setup: TrainerSetup, cmds, results) -> None:
    """Command loop of one training rank. Every reply carries the command's sequence number,
    so a reply left over from a failed command can never be taken for the next one's."""
    try:
        state = _Rank(rank, setup)
        results.put((rank, 0, True, None))
    except BaseException:  # noqa: BLE001 - reported to the driver with its traceback
        results.put((rank, 0, False, f"in start-up:\n{traceback.format_exc()}"))
        return
    while True:
        seq, cmd, args = cmds.get()
        if cmd == "stop":
            state.close()
            results.put((rank, seq, True, None))
            return
        try:
            out = getattr(state, cmd)(*args)
            results.put((rank, seq, True, pickle.dumps(out)))
        except BaseException:  # noqa: BLE001
            results.put((rank, seq, False, f"in {cmd!r}:\n{traceback.format_exc()}"))


class TrainerPool:
    """``world`` megatron ranks in spawned processes, driven by commands from this process.

    The queues are local IPC between this process and the ranks it spawned (the refit group's
    control plane is separate and authenticated)."""

    def __init__(self, setup: TrainerSetup) -> None:
        import torch.multiprocessing as mp

        self.setup = setup
        self.world_size = setup.par.world_size
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._cmds = [ctx.Queue() for _ in range(self.world_size)]
        self.procs = [ctx.Process(target=_rank_main, args=(r, setup, self._cmds[r], self._results), daemon=True)
                      for r in range(self.world_size)]
        for p in self.procs:
            p.start()
        self._pending: str | None = None
        self._seq = 0
        try:
            self._collect("start-up", setup.timeout_s)
        except BaseException:
            self.close()  # never leave half a pool running
            raise

    def submit(self, cmd: str, *args: Any) -> None:
        """Start ``cmd`` on every rank without waiting (pair with :meth:`collect`)."""
        self.submit_each(cmd, [args] * self.world_size)

    def submit_each(self, cmd: str, args_per_rank: Sequence[tuple]) -> None:
        """Start ``cmd`` with rank-specific arguments (e.g. each rank's plan slice)."""
        if self._pending is not None:
            raise RuntimeError(f"command {self._pending!r} still pending")
        self._pending = cmd
        self._seq += 1
        for q, args in zip(self._cmds, args_per_rank, strict=True):
            q.put((self._seq, cmd, tuple(args)))

    def collect(self, timeout_s: float | None = None) -> list[Any]:
        cmd, self._pending = self._pending, None
        if cmd is None:
            raise RuntimeError("nothing submitted")
        return self._collect(cmd, timeout_s or self.setup.timeout_s)

    def call(self, cmd: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        self.submit(cmd, *args)
        return self.collect(timeout_s)

    def _collect(self, cmd: str, timeout_s: float) -> list[Any]:
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world_size)) - set(out))
                raise TrainerError(f"training rank(s) {missing} did not finish {cmd!r} within {timeout_s:.0f}s")
            try:
                rank, seq, ok, value = self._results.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(self.procs) if r not in out and not p.is_alive()]
                if dead:
                    raise TrainerError(f"training rank {dead[0]} died (exit code {self.procs[dead[0]].exitcode}) "
                                       f"during {cmd!r}") from None
                continue
            if seq != self._seq:
                continue  # a reply to an earlier command that failed elsewhere first
            if not ok:
                raise TrainerError(f"training rank {rank} failed {value}")
            out[rank] = pickle.loads(value) if isinstance(value, bytes) else value
        return [out[r] for r in range(self.world_size)]

    def dead(self) -> list[str]:
        """One line per rank whose process is gone (named in a failed refit's error)."""
        return [f"training rank {r} died (exit code {p.exitcode})" for r, p in enumerate(self.procs)
                if not p.is_alive()]

    def kill(self, rank: int) -> None:
        """Kill one rank (failure tests)."""
        self.procs[rank].kill()

    def close(self) -> None:
        for r, q in enumerate(self._cmds):
            if self.procs[r].is_alive():
                q.put((-1, "stop", ()))
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
