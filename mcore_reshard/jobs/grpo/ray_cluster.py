"""Ray as the distributed engine: trainer ranks and vLLM engines as actors in placement groups.

As NeMo RL does it: the training ranks sit in one PACK placement group (a bundle of one
device each: a GPU, or a CPU slot on a CPU-only cluster), every vLLM engine in a group of its
own (one bundle of its ``tp`` devices), so the
two sides land on separate nodes of a real cluster when the training bundles fill theirs. The
refit group's master is the first training bundle: its node IP (asked there, never assumed) and
a port free on that node. The driver talks to the actors through the same rank protocol as to
local processes (:class:`RayTrainerGroup` implements ``ranks.TrainerGroup`` over actors; an
engine actor is a refit destination, :class:`ActorDestination`), so
:class:`~mcore_reshard.refit.driver.RefitDriver` runs unchanged.

Security: an embedded cluster (no address) runs with Ray's token auth and a per-job token in
``RAY_AUTH_TOKEN`` (nothing is written to ``~/.ray``); its session files go to a temporary
directory removed at shutdown. Joining a cluster (``address``) uses that cluster's own token
(``RAY_AUTH_TOKEN``/``RAY_AUTH_TOKEN_PATH``/``~/.ray/auth_token``, as Ray documents).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from ...adapters.vllm.engine import Completion, close_engine, sample
from ...adapters.vllm.plugin import BACKEND
from ...layout.lora import PeftConfig
from ...errors import RefitFailed, TrainerError
from ...infra.ports import free_port
from ...wire.protocol import DETAIL_MARK, first_error_line
from ...training.ranks import RankCall, TrainerGroup
from ...training.pool import trainer_rank
from ..refit import policy_engine_args

__all__ = ["RayJob", "RayTrainerGroup", "EngineActor", "AsyncEngineActor", "EngineHandle", "ActorDestination",
           "Completion", "start_engines", "node_of"]

#: How long start-up (a model built on every training rank, an engine loaded and compiled) may
#: take. Longer than a refit's call timeout: on two loaded cores an engine start has taken
#: over 120 s.
START_TIMEOUT_S = 600.0


def _prepare_env(embedded: bool) -> None:
    """An embedded cluster runs with token auth on a per-job token in the environment (Ray
    would otherwise write ``~/.ray/auth_token``). Ray caches its auth mode and token when it is
    imported (vLLM imports it too): if it is already loaded, refresh both the way Ray's own
    ``ray.init`` does when it turns token auth on (``Config.initialize``)."""
    import sys

    if embedded and not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        if "ray" in sys.modules:
            from ray._raylet import AuthenticationTokenLoader, Config

            Config.initialize("")
            AuthenticationTokenLoader.instance().reset_cache()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")


class RayJob:
    """Connect to Ray for one job: ``address=None`` starts an embedded local cluster (the
    default, nothing to set up), ``"auto"``/``"host:port"`` joins a running one. A context
    manager; leaving it shuts down what it started and removes its files."""

    def __init__(self, address: str | None = None, num_cpus: int | None = None) -> None:
        self.address, self.num_cpus = address, num_cpus
        self._tmp: str | None = None
        self._started = False

    def __enter__(self) -> "RayJob":
        _prepare_env(self.address is None)
        import ray

        if ray.is_initialized():  # a caller (a test's simulated cluster) connected already
            return self
        if self.address is None:
            self._tmp = tempfile.mkdtemp(prefix="mr_ray_", dir="/tmp")  # short: Ray's socket paths
            ray.init(num_cpus=self.num_cpus, num_gpus=0, include_dashboard=False, _temp_dir=self._tmp,
                     configure_logging=False, log_to_driver=False)
        else:
            ray.init(address=self.address, configure_logging=False, log_to_driver=False)
        self._started = True
        return self

    def __exit__(self, *exc: Any) -> None:
        import ray

        if self._started:
            ray.shutdown()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


#: How many lines of a crashed actor's stderr its error carries (:func:`last_words`).
_LAST_WORDS = 12


def last_words(exc: BaseException) -> str:
    """The end of the stderr of an actor that died unexpectedly (``exc``: Ray's error, which
    names its pid), from Ray's worker log on this node, as an indented block to append to the
    error; ``""`` for a kill or where the log is not here. Ray reports a crashed worker only
    as "exits with a connection error" and removes an embedded cluster's logs at shutdown, so
    without this a crash leaves no trace. Ray's workers run with ``faulthandler`` on: after a
    fatal signal the block is the Python stack it printed; after a SIGKILL (the kernel's OOM
    killer, which Ray points at its workers first) it is the log's last lines."""
    import glob
    import re

    text = str(exc)
    pid = re.search(r"^\s*pid: (\d+)$", text, re.MULTILINE)
    if "SYSTEM_ERROR" not in text or pid is None:
        return ""
    try:
        import ray._private.worker as ray_worker

        logs = ray_worker._global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - not a driver with a node of the cluster here
        return ""
    lines: list[str] = []
    for path in sorted(glob.glob(os.path.join(logs, f"worker-*-{pid[1]}.err"))):
        with open(path, errors="replace") as f:
            lines += [line.rstrip() for line in f.readlines()[-400:]
                      if line.strip() and not line.startswith("Extension modules:")]  # faulthandler's list
    fatal = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    tail = lines[fatal[-1]:][:_LAST_WORDS] if fatal else lines[-_LAST_WORDS:]
    if not tail:
        return ""
    return f"\n  pid {pid[1]}{DETAIL_MARK}\n" + "\n".join(f"    {line[:300]}" for line in tail)


def node_of() -> dict:
    """Where the calling process runs (node id, IP, pid)."""
    import ray

    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}


# ---------------------------------------------------------------------------- trainers


class _TrainerActor:
    """One training rank (``pool.trainer_rank``: policy + its end of the refit) in a Ray actor,
    answering the rank protocol's typed calls."""

    def __init__(self) -> None:
        self.rank: Any = None

    def where(self) -> dict:
        return node_of()

    def free_port(self, host: str) -> int:
        return free_port(host)

    def start(self, rank: int, setup: Any) -> None:
        from ...adapters.megatron.runtime import quiet_cpu_notices

        quiet_cpu_notices()  # the job said it once
        self.rank = trainer_rank(rank, setup)

    def run(self, call: RankCall[Any]) -> Any:
        return call.run(self.rank)

    def close(self) -> None:
        if self.rank is not None:
            self.rank.close()


def _devices(n: int) -> dict[str, float]:
    """A bundle of ``n`` devices: GPUs where the cluster has them (one CPU each alongside),
    else CPUs -- the "device slots" of a CPU-only cluster."""
    import ray

    return {"CPU": n, "GPU": n} if ray.cluster_resources().get("GPU", 0) > 0 else {"CPU": n}


def _strategy(pg: Any, bundle: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)


def _placement_group(bundles: list[dict], name: str, timeout_s: float) -> Any:
    import ray
    from ray.util.placement_group import placement_group

    pg = placement_group(bundles, strategy="PACK", name=name)
    if not _ready(pg, timeout_s):
        ray.util.remove_placement_group(pg)
        need = sum(b.get("CPU", 0) for b in bundles)
        raise RefitFailed(f"placement group {name!r} ({len(bundles)} bundles, {need} CPUs) could not be placed "
                          f"within {timeout_s:.0f}s: the Ray cluster has {ray.available_resources()} free")
    return pg


def _ready(pg: Any, timeout_s: float) -> bool:
    import ray

    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    return bool(ready)


class RayTrainerGroup(TrainerGroup):
    """The training ranks (``ranks.TrainerGroup``) as Ray actors that each hold one rank and
    answer ``run(call)`` with ``call.run(rank)`` -- a framework's own training actors fit as
    they are (``RayTrainerGroup(actors)``); :meth:`megatron` starts this project's. A dead actor
    is named as soon as Ray knows, not at the timeout."""

    def __init__(self, actors: Sequence[Any], *, timeout_s: float = 300.0) -> None:
        self.actors = list(actors)
        self.world_size = len(self.actors)
        self.timeout_s = timeout_s
        self._dead: dict[int, str] = {}
        self.pg: Any = None  # set where this group placed (and owns) its actors
        self._starting: list = []

    @classmethod
    def megatron(cls, setup: Any, *, timeout_s: float = 300.0, name: str = "mr_trainers",
                 wait: bool = True) -> "RayTrainerGroup":
        """``setup.par.world_size`` training ranks (``pool.trainer_rank``) as Ray actors in
        one placement group, which this group owns (``close`` ends them).

        Start-up: the actors are placed first, rank 0 reports its node IP and two free ports
        (megatron's rendezvous, then each refit group's), and only then every rank builds its
        model, all at once (megatron's groups need every rank)."""
        import ray

        self = cls([], timeout_s=timeout_s)
        self.world_size = setup.par.world_size
        try:
            device = _devices(1)
            self.pg = _placement_group([device] * self.world_size, name, timeout_s)
            actor = ray.remote(num_cpus=1, num_gpus=device.get("GPU", 0), max_restarts=0)(_TrainerActor)
            self.actors = [actor.options(scheduling_strategy=_strategy(self.pg, r), name=f"{name}_{r}").remote()
                           for r in range(self.world_size)]
            self.nodes = self._get([a.where.remote() for a in self.actors], "placement")
            self.host = self.nodes[0]["ip"]
            port = self._get([self.actors[0].free_port.remote(self.host)], "a free port")[0]
            setup = replace(setup, host=self.host, port=port)
            self._starting = [a.start.remote(r, setup) for r, a in enumerate(self.actors)]
            if wait:
                self.started()
        except BaseException:
            self.close()
            raise
        return self

    def started(self) -> "RayTrainerGroup":
        """Wait until every rank has built its model (``wait=False`` overlaps this with the
        engines' start-up), for at most ``START_TIMEOUT_S`` (or the call timeout if longer)."""
        refs, self._starting = self._starting, []
        if refs:
            self._get(refs, "start-up", max(self.timeout_s, START_TIMEOUT_S))
        return self

    def free_port(self) -> int:
        """A port free on training rank 0's node (each refit group's master listens there)."""
        return self._get([self.actors[0].free_port.remote(self.host)], "a free port")[0]

    def _send(self, what: str, calls: Sequence[RankCall[Any]]) -> Callable[[float, bool], list[Any]]:
        refs = [a.run.remote(c) for a, c in zip(self.actors, calls, strict=True)]
        return lambda timeout_s, every: self._get(refs, what, timeout_s, every)

    def _get(self, refs: list, what: str, timeout_s: float | None = None, every: bool = False) -> list[Any]:
        """Every reply, or the first failure as one ``TrainerError`` naming the rank (with
        ``every``, raised once every other rank is done too: ``Pending.wait``)."""
        import ray
        from ray.exceptions import RayActorError

        timeout_s = timeout_s or self.timeout_s
        index = {ref: r for r, ref in enumerate(refs)}
        left = list(refs)
        deadline = time.monotonic() + timeout_s
        failed: list[str] = []
        while left and not (failed and not every):
            wait = deadline - time.monotonic()
            if wait <= 0:
                if failed:
                    break
                missing = sorted(index[r] for r in left)
                raise TrainerError(f"training rank(s) {missing} did not finish {what!r} within {timeout_s:.0f}s")
            done, left = ray.wait(left, num_returns=1, timeout=wait)
            for ref in done:
                try:
                    ray.get(ref)
                except RayActorError as exc:
                    r = index[ref]
                    self._dead[r] = f"training rank {r} (Ray actor {self.actors[r]._actor_id.hex()[:12]}) died"
                    failed.append(f"{self._dead[r]} during {what!r}: {first_error_line(exc)}{last_words(exc)}")
                except Exception as exc:  # noqa: BLE001 - the rank's own error, named
                    cause = getattr(exc, "cause", None) or exc
                    failed.append(f"training rank {index[ref]} failed in {what!r}: {first_error_line(cause)}")
        if failed:
            raise TrainerError(failed[0])
        return ray.get(list(refs))

    def dead(self) -> list[str]:
        return list(self._dead.values())

    def kill(self, rank: int) -> None:
        """Kill one rank's actor (failure tests)."""
        import ray

        ray.kill(self.actors[rank], no_restart=True)

    def close(self) -> None:
        """End the actors this group started (:meth:`megatron`); a framework's own are its own."""
        import ray

        if self.pg is None:
            return
        refs = [a.close.remote() for r, a in enumerate(self.actors) if r not in self._dead]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=10)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None


# ---------------------------------------------------------------------------- engines


class EngineActor:
    """One vLLM engine (``LLM`` with the ``mcore_reshard`` weight-transfer backend and the
    diagnostics extension) in a Ray actor; its workers are the actor's child processes."""

    def __init__(self, model_dir: str, tp: int, dtype: str, apply_mode: str, env: dict[str, str],
                 peft: PeftConfig | None = None, speculative_config: dict | None = None) -> None:
        os.environ.update(env)
        from ...adapters.vllm.engine import start_engine
        from ...adapters.vllm.worker import REFIT_EXTENSION

        extra = {"distributed_executor_backend": "mp"} if tp > 1 else {}
        self.peft = peft
        self.llm = start_engine(model_dir, tp=tp, dtype=dtype, direct=apply_mode == "direct",
                                worker_extension_cls=REFIT_EXTENSION, weight_transfer_config={"backend": BACKEND},
                                **extra, **policy_engine_args(peft, speculative_config))

    def where(self) -> dict:
        from ...adapters.vllm.engine import engine_info

        return {**node_of(), "engine": engine_info(self.llm)}

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.llm, name)(*args, **kwargs)

    def step(self, name: str, *args: Any) -> Any:
        """One refit step (a ``Destination`` method) on the engine's in-process destination."""
        return getattr(_held_destination(self), name)(*args)

    def sample(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
               seed: int, images: list | None = None, never: tuple = ()) -> list[list[Completion]]:
        """``n`` sampled completions per prompt (see :func:`completions`); ``images``: each
        prompt's image (a vision-language policy's), ``never``: token ids no completion holds."""
        return sample(self.llm, prompts, n, max_tokens, temperature, seed, self.peft, images, never)

    def shutdown(self) -> None:
        close_engine(self.llm)


class AsyncEngineActor:
    """``policy.generation.vllm_cfg.async_engine``: one vLLM ``AsyncLLM`` (the engine behind
    ``vllm serve``) in an async Ray actor. Its sample requests and the refit driver's calls run
    at once: a refit's ``update_weights`` / ``finish_weight_update`` run in a thread while
    requests keep decoding on the engine's own event loop; completions carry the weight
    versions that produced each token."""

    def __init__(self, model_dir: str, tp: int, dtype: str, apply_mode: str, env: dict[str, str],
                 peft: PeftConfig | None = None, speculative_config: dict | None = None) -> None:
        os.environ.update(env)
        from ...adapters.vllm.engine import start_async_engine
        from ...adapters.vllm.worker import REFIT_EXTENSION

        extra = {"distributed_executor_backend": "mp"} if tp > 1 else {}
        self.peft = peft
        self.llm = start_async_engine(model_dir, tp=tp, dtype=dtype, direct=apply_mode == "direct",
                                      worker_extension_cls=REFIT_EXTENSION, weight_transfer_config={"backend": BACKEND},
                                      **extra, **policy_engine_args(peft, speculative_config))

    async def where(self) -> dict:
        return {**node_of(), "engine": self.llm.engine_info}

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """A driver call (blocking on the engine's loop) in a thread: requests keep running."""
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(None, lambda: getattr(self.llm, name)(*args, **kwargs))

    async def step(self, name: str, *args: Any) -> Any:
        """One refit step on the engine's in-process destination, in a thread (requests keep
        decoding on the engine's loop)."""
        import asyncio

        dest = _held_destination(self)
        return await asyncio.get_running_loop().run_in_executor(None, lambda: getattr(dest, name)(*args))

    async def sample(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
                     seed: int, images: list | None = None, never: tuple = ()) -> list[list[Completion]]:
        """As :meth:`EngineActor.sample`; the requests run on the engine's loop while this
        actor keeps answering (a refit's calls among them)."""
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(
            None, sample, self.llm, prompts, n, max_tokens, temperature, seed, self.peft, images, never)

    async def shutdown(self) -> None:
        close_engine(self.llm)


def _held_destination(actor: Any) -> Any:
    """The destination of the engine an actor holds (``refit.engines.as_destination``: an
    ``LLM`` or ``AsyncEngine`` as ``adapters.vllm.destination.VllmEngine``), made once."""
    dest = actor.__dict__.get("_destination")
    if dest is None:
        from ...refit.engines import as_destination

        dest = actor._destination = as_destination(actor.llm)
    return dest


class EngineHandle:
    """The driver's view of an engine actor: an ``LLM``'s weight-transfer and diagnostics calls
    (``collective_rpc``, ``init_weight_transfer_engine``, ``update_weights``, ...) run remotely
    with a timeout; what the engine is (``engine_info``: world size, dtype, parallel sizes,
    worker extension) is known up front, and ``info`` says where it runs."""

    def __init__(self, actor: Any, index: int, info: dict, timeout_s: float) -> None:
        self.actor, self.index, self.timeout_s = actor, index, timeout_s
        self.engine_info = info["engine"]
        self.info = {k: v for k, v in info.items() if k != "engine"}  # node_id, ip, pid
        self.world_size, self.dtype = self.engine_info.world_size, self.engine_info.dtype

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.wait(name, self.actor.call.remote(name, *args, **kwargs))

    def wait(self, name: str, ref: Any) -> Any:
        """The result of the actor's call ``name`` (``ref``) within the handle's timeout; a
        dead actor, a missed deadline or the engine's own error as one line naming the engine."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except RayActorError as exc:
            raise RefitFailed(f"engine {self.index} (Ray actor {self.actor._actor_id.hex()[:12]}) died during "
                              f"{name!r}: {first_error_line(exc)}{last_words(exc)}") from None
        except GetTimeoutError:
            raise RefitFailed(f"engine {self.index} did not finish {name!r} within {self.timeout_s:.0f}s") from None
        except Exception as exc:  # noqa: BLE001 - the engine's own error, as its own type where it can be rebuilt
            cause = getattr(exc, "cause", None) or exc
            line = first_error_line(cause)
            try:
                err = type(cause)(line)
            except Exception:  # noqa: BLE001 - a type that takes other arguments: name it instead
                err = RefitFailed(f"engine {self.index} failed in {name!r}: {type(cause).__name__}: {line}")
            raise err from None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._call(name, *args, **kwargs)

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        """Start sampling (returns a Ray object ref: engines sample concurrently)."""
        return self.actor.sample.remote(*args, **kwargs)


class ActorDestination:
    """A Ray actor holding an engine, as a refit destination (``transport.destination``): each
    step of the protocol is one remote call, which the actor runs on the in-process destination
    of the engine it holds (:func:`_held_destination`) and answers within the handle's
    deadline. Nothing here knows the engine's kind: the actor's own adapter does."""

    def __init__(self, handle: EngineHandle) -> None:
        self.handle = handle
        self._info: Any = None

    def __repr__(self) -> str:
        return f"ActorDestination(engine {self.handle.index})"

    def _step(self, name: str, *args: Any) -> Any:
        return self.handle.wait(name, self.handle.actor.step.remote(name, *args))

    def info(self) -> Any:
        if self._info is None:  # what the engine is does not change: asked once
            self._info = replace(self._step("info"), name=f"engine {self.handle.index}")
        return self._info

    def describe(self, spec: Any) -> Any:
        return self._step("describe", spec)

    def join(self, init: Any) -> None:
        self._step("join", init)

    def pause(self, swap: bool) -> None:
        self._step("pause", swap)

    def begin(self) -> None:
        self._step("begin")

    def transfer(self, update: Any) -> None:
        self._step("transfer", update)

    def conclude(self, version: str | None) -> None:
        self._step("conclude", version)

    def status(self) -> Any:
        return self._step("status")

    def refresh(self, version: str, recompute: bool = False, encoders: bool = False) -> str:
        return self._step("refresh", version, recompute, encoders)

    def resume(self) -> None:
        self._step("resume")

    def close(self) -> None:
        self._step("close")


def start_engines(model_dir: str, replicas: int, tp: int, dtype: str, apply_mode: str, *, timeout_s: float,
                  start_timeout_s: float = START_TIMEOUT_S, env: dict[str, str] | None = None,
                  name: str = "mr_engine", async_engine: bool = False,
                  peft: PeftConfig | None = None,
                  speculative_config: dict | None = None) -> tuple[list[EngineHandle], list]:
    """``replicas`` engine actors (:class:`AsyncEngineActor` with ``async_engine``, else
    :class:`EngineActor`), each in a placement group of one bundle of ``tp`` devices.
    Each must be up within ``start_timeout_s`` (a model load and a compile: slower than any
    refit call, and much slower on a loaded machine); its calls then get ``timeout_s``.
    Returns the handles and the placement groups (remove them at shutdown)."""
    import ray
    from ray.exceptions import GetTimeoutError

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"), **(env or {})}
    pgs, actors = [], []
    try:
        for e in range(replicas):
            # One bundle per engine: its tp workers are the actor's child processes and see the
            # bundle's devices (Ray sets CUDA_VISIBLE_DEVICES for the actor on GPU clusters).
            device = _devices(tp)
            pg = _placement_group([device], f"{name}_{e}", timeout_s)
            pgs.append(pg)
            cls = ray.remote(num_cpus=tp, num_gpus=device.get("GPU", 0), max_restarts=0)(
                AsyncEngineActor if async_engine else EngineActor)
            actors.append(cls.options(scheduling_strategy=_strategy(pg, 0), name=f"{name}_{e}")
                          .remote(model_dir, tp, dtype, apply_mode, env, peft, speculative_config))
        infos = []
        for e, a in enumerate(actors):
            try:
                infos.append(ray.get(a.where.remote(), timeout=start_timeout_s))
            except GetTimeoutError:
                raise RefitFailed(f"engine {e} did not start within {start_timeout_s:.0f}s") from None
            except Exception as exc:  # noqa: BLE001
                raise RefitFailed(f"engine {e} failed to start: {first_error_line(getattr(exc, 'cause', None) or exc)}") \
                    from None
    except BaseException:
        stop_engines(actors, pgs)
        raise
    return [EngineHandle(a, e, info, timeout_s) for e, (a, info) in enumerate(zip(actors, infos))], pgs


def stop_engines(actors: Sequence[Any], pgs: Sequence[Any]) -> None:
    import ray

    actors = [getattr(a, "actor", a) for a in actors]
    refs = [a.shutdown.remote() for a in actors]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=30)
    for a in actors:
        ray.kill(a, no_restart=True)
    for pg in pgs:
        ray.util.remove_placement_group(pg)
