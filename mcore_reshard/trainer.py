"""Training-side processes of the refit job: a pool of megatron-core ranks that keep their
model between commands (describe, join the refit group, refit, optimizer step, logprobs).

Each rank is a spawned process with a command loop; the driver talks to it over queues and
every wait has a timeout. Refit bytes move only over the refit group (``transport``); the
queues carry commands, plan slices and results (and, for ``verify=full`` checks only, copies
of the local weights).
"""

from __future__ import annotations

import pickle
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

from .adapters.megatron.rules import MegatronParallel
from .layout import ModelSpec

__all__ = ["TrainerSetup", "TrainerPool", "TrainerError"]


class TrainerError(RuntimeError):
    """A training rank failed or died; the message names the rank."""


@dataclass(frozen=True)
class TrainerSetup:
    spec: ModelSpec
    par: MegatronParallel
    checkpoint: str  # HF checkpoint directory, loaded through the descriptors
    port: int  # megatron's own default group rendezvous
    timeout_s: float = 300.0
    threads: int = 1


class _Rank:
    """The state a training rank keeps between commands."""

    def __init__(self, rank: int, setup: TrainerSetup) -> None:
        import torch

        from .adapters.megatron.build import build_gpt, init_megatron
        from .adapters.megatron.live import describe, named_local_params
        from .layout.torch_views import write_pieces
        from .testing.tiny import load_canonical

        torch.set_num_threads(setup.threads)
        self.rank, self.setup, self.spec = rank, setup, setup.spec
        init_megatron(setup.par, rank, setup.par.world, "127.0.0.1", setup.port, setup.timeout_s)
        self.chunks = build_gpt(self.spec, setup.par)
        self.params = named_local_params(self.chunks)
        self.descs = describe(self.chunks, self.spec)
        canonical = load_canonical(setup.checkpoint)
        with torch.no_grad():
            for lp in self.descs:
                t = self.params[lp.name].data
                t.zero_()  # padding rows stay zero
                write_pieces(t, lp.pieces, canonical)
        self.group = None
        self.hf_group = None
        self.optimizer = None

    # -- commands ------------------------------------------------------------------------
    def describe(self):
        return self.descs

    def join(self, host: str, port: int, world: int, rank_map, timeout_s: float) -> int:
        """(Re)build this rank's refit group; a previous one (e.g. broken by a failed refit)
        is closed first."""
        from .transport.group import RefitGroup

        if self.group is not None:
            self.group.close(barrier=False)
        self.group = RefitGroup.create(host, port, rank_map.group_rank("src", self.rank), world, timeout_s,
                                       is_master=rank_map.group_rank("src", self.rank) == 0, rank_map=rank_map)
        return self.group.rank

    def set_plan(self, slice_bytes: bytes, digest: str, slice_digest: str) -> str:
        """Keep this rank's slice of the plan (sent once per layout; refits then name the plan
        by digest only). The slice is re-hashed here, so what this rank runs is provably the
        slice the driver cut from the plan every rank agrees on."""
        plan_slice = pickle.loads(slice_bytes)
        if plan_slice.side != "src" or plan_slice.rank != self.rank or plan_slice.digest() != slice_digest:
            raise RuntimeError(f"training rank {self.rank}: the plan slice received does not match its digest "
                               f"(rank {plan_slice.rank}, side {plan_slice.side})")
        self.plan_slice, self.plan_digest = plan_slice, digest
        return slice_digest

    def _slice(self, digest: str):
        held = getattr(self, "plan_digest", None)
        if held != digest:
            raise RuntimeError(f"training rank {self.rank}: asked to run plan {digest}, holds {held}")
        return self.plan_slice

    def refit(self, digest: str, verify: bool, timeout_s: float, progress: bool):
        from .transport.executor import execute_plan

        if self.group is None:
            raise RuntimeError("refit before joining the refit group")
        plan_slice = self._slice(digest)
        sync_params_before_refit(self.chunks)
        tensors = {name: p.data for name, p in self.params.items()}
        try:
            return execute_plan(plan_slice, None, tensors, None, self.group, timeout_s=timeout_s, verify=verify,
                                progress=progress and self.rank == 0, plan_digest=digest)
        except BaseException:
            self.group.close(barrier=False)  # a failed group is broken: join() makes a new one
            self.group = None
            raise

    def refit_and_die(self, digest: str, timeout_s: float, die_rank: int, after_reads: int):
        """Failure tests: like :meth:`refit`, but rank ``die_rank`` exits abruptly after its
        packer has read ``after_reads`` source tensors -- a trainer dying mid-refit."""
        import os

        from .transport.executor import execute_plan

        tensors = {name: p.data for name, p in self.params.items()}
        if self.rank == die_rank:
            tensors = _DieAfter(tensors, after_reads, os._exit)
        return execute_plan(self._slice(digest), None, tensors, None, self.group, timeout_s=timeout_s,
                            verify=True, plan_digest=digest)

    def hf_join(self, host: str, port: int, world: int, timeout_s: float) -> None:
        """Baseline broadcast group: training rank 0 (root) and every vLLM worker."""
        from .transport.group import RefitGroup

        if self.rank == 0:
            self.hf_group = RefitGroup.create(host, port, 0, world, timeout_s, is_master=True,
                                              prefix="mcore_reshard/hf")

    def hf_send(self, gather_plan_bytes: bytes, buffer_bytes: int, timeout_s: float) -> dict:
        """Baseline: gather every tensor whole on rank 0 (HF names and layout), which then
        broadcasts them bucket by bucket to every vLLM worker."""
        import torch

        from .baseline import broadcast_send
        from .layout.torch_views import TORCH_DTYPES
        from .transport.executor import execute_plan
        from .transport.group import RankMap

        t0 = time.perf_counter()
        sync_params_before_refit(self.chunks)
        plan = pickle.loads(gather_plan_bytes)
        rank_map = RankMap(tuple(range(self.setup.par.world)), (0,))  # gather into training rank 0
        tensors = self.spec.tensor_table()
        full = None
        if self.rank == 0:
            full = {n: torch.empty(shape, dtype=TORCH_DTYPES[dt]) for n, (shape, dt) in tensors.items()}
        local = {name: p.data for name, p in self.params.items()}
        gather = execute_plan(plan.for_rank("src", self.rank), plan.for_rank("dst", 0) if full is not None else None,
                              local, full, self.group, rank_map, timeout_s=timeout_s, verify=False)
        peak = gather.peak_extra_bytes
        if full is not None:
            sent = broadcast_send(full, tensors, self.hf_group, buffer_bytes=buffer_bytes, timeout_s=timeout_s)
            peak += sent.peak_extra_bytes + sum(t.numel() * t.element_size() for t in full.values())
        return {"gather": gather, "seconds": time.perf_counter() - t0, "peak_extra_bytes": peak}

    def step(self, tokens: Sequence[int], lr: float) -> float:
        """One AdamW step of next-token cross-entropy on ``tokens`` (so weights really change)."""
        import torch

        model = self.chunks[0]
        # Autograd does not need train mode (dropout is 0 here); megatron's MoELayer refuses
        # train mode with TP but no sequence parallelism, and SP needs a GPU-only norm.
        model.eval()
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        x = torch.tensor([list(tokens)])
        logits = forward_logits(model, x, self.spec.vocab)[0]
        loss = torch.nn.functional.cross_entropy(logits[:-1].float(), x[0, 1:])
        self.optimizer.zero_grad()
        loss.backward()
        _sum_qk_norm_grads_over_tp(model)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # free the grads before the refit that follows
        return float(loss.detach())

    def logprobs(self, tokens: Sequence[int]) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1, from a megatron forward (every rank runs it)."""
        import torch

        model = self.chunks[0]
        model.eval()
        x = torch.tensor([list(tokens)])
        with torch.no_grad():
            logits = forward_logits(model, x, self.spec.vocab)[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        return [float(lp[i - 1, t]) for i, t in enumerate(tokens) if i > 0]

    def local_tensors(self) -> dict[str, Any]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def close(self) -> None:
        for attr in ("group", "hf_group"):
            g = getattr(self, attr)
            if g is not None:
                g.close(barrier=False)
                setattr(self, attr, None)

    def raw_bandwidth(self, pairs: Sequence[tuple[int, int]], nbytes: int, timeout_s: float) -> float | None:
        """One ``nbytes`` message per (source, destination) group-rank pair, all pairs at once,
        over the refit group: the local floor ``scripts/bench_refit.py`` compares a refit with.
        Bytes/s of this rank's pair; None on a rank in no pair."""
        from .transport.executor import raw_send_bandwidth

        if self.group is None:
            raise RuntimeError("raw_bandwidth before joining the refit group")
        mine = [(s, d) for s, d in pairs if self.group.rank in (s, d)]
        return raw_send_bandwidth(self.group, *mine[0], nbytes, timeout_s) if mine else None


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


def forward_logits(model, tokens, vocab: int):
    """Megatron forward with the vocab-parallel logits gathered over TP and padding dropped."""
    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    pos = torch.arange(tokens.shape[1])[None]
    out = model(tokens, pos, attention_mask=None)
    return gather_from_tensor_model_parallel_region(out)[..., :vocab]


def _sum_qk_norm_grads_over_tp(model) -> None:
    """Each TP rank normalises only its own heads, so q/k layernorm grads are partial sums:
    megatron's ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) sums
    them over TP. This loop does the same for the unwrapped model (no DDP here)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() <= 1:
        return
    for name, p in model.named_parameters():
        if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=ps.get_tensor_model_parallel_group())


def sync_params_before_refit(chunks) -> None:
    """With the distributed optimizer and overlapped param all-gather, bf16 params are only
    whole after the gather: force it before reading them (no-op for unwrapped models)."""
    for chunk in chunks:
        sync = getattr(chunk, "start_param_sync", None)
        if callable(sync):
            sync(force_sync=True)


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
    """``world`` megatron ranks in spawned processes, driven by commands from this process."""

    def __init__(self, setup: TrainerSetup) -> None:
        import torch.multiprocessing as mp

        self.setup = setup
        self.world = setup.par.world
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._cmds = [ctx.Queue() for _ in range(self.world)]
        self.procs = [ctx.Process(target=_rank_main, args=(r, setup, self._cmds[r], self._results), daemon=True)
                      for r in range(self.world)]
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
        self.submit_each(cmd, [args] * self.world)

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
        while len(out) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world)) - set(out))
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
        return [out[r] for r in range(self.world)]

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
