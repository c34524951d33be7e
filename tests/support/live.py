"""Session caches of what the live tests start: tiny checkpoints, vLLM engines and megatron
trainer pools, each keyed by what makes one differ from another.

- ``Checkpoints.get(family/moe, dtype, seed, overrides)``: one directory per key.
- ``EngineCache.get(ckpt, tp, dtype, enable_ep, direct)``: an engine started as
  ``local_cluster`` starts its own (the worker extension every transport of the local job
  needs, the ``mcore_reshard`` weight-transfer backend), keyed by the model's
  architecture (its ``config.json``: same shapes, same plan), dtype, TP, EP and apply mode. It is started on the first requester's checkpoint; after that it serves whatever the
  last refit wrote, so a test that shares an engine refits before it asserts on weights. At
  most ``max_engines`` run at once (least recently used stopped first), and one that a test
  left paused, not serving or dead is stopped, never handed out again.
- ``PoolCache``: megatron trainer pools keyed by their ``TrainerSetup`` less its port
  (checkpoint, dtype, layout, training settings, param sync). ``cluster()`` is the package's
  own ``local_cluster`` with its ``LocalTrainerGroup`` taken from this cache while it starts: on exit
  the pool goes back to the cache (trained weights and all: tests assert on relative changes)
  unless a rank of it died. ``LocalCluster.restart_trainers`` inside a test starts a new pool
  from the checkpoint as before (a restarted job), and that one is kept instead. Tests use
  ``cluster()`` only for layouts another test reuses (at most ``max_idle`` pools wait) and
  ``local_cluster`` for the rest.

Tests that kill an engine, or need one that serves its checkpoint untouched, start their own.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from mcore_reshard.testing.clients import enqueued_logprobs  # noqa: F401 - the tests' import

__all__ = ["Checkpoints", "EngineCache", "PoolCache", "cluster", "POOLS", "engine_healthy", "rss_mib", "refit_pids",
           "assert_idle", "trained_checkpoint", "enqueued_logprobs"]


# --------------------------------------------------------------------------- checkpoints


class Checkpoints:
    """Tiny random HF checkpoints, written once per key under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._made: dict[str, Path] = {}

    def get(self, *, family: str | None = None, moe: bool = False, dtype: str = "float32", seed: int = 0,
            overrides: dict | None = None) -> Path:
        from mcore_reshard.infra.checkpoint import make_tiny_checkpoint

        family = family or ("qwen3_moe" if moe else "qwen3")
        blob = json.dumps(overrides or {}, sort_keys=True, default=repr)
        key = f"{family}-{dtype}-s{seed}-" + hashlib.sha256(blob.encode()).hexdigest()[:8]
        path = self._made.get(key)
        if path is None:
            path = make_tiny_checkpoint(self.root / key, overrides=overrides, family=family, dtype=dtype, seed=seed)
            self._made[key] = path
        return path


# --------------------------------------------------------------------------- engines


def model_key(ckpt: Path | str) -> str:
    """The architecture of a checkpoint (its config.json): engines of one key take one plan."""
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    cfg.pop("_name_or_path", None)
    cfg.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def engine_extension() -> str:
    """The worker extension ``local_cluster`` starts its own engines with: every transport of
    the local job (the diagnostics one, or the HF baseline's, which extends it)."""
    try:
        from mcore_reshard.jobs.refit import engine_extension as extension_for, job_transports

        return extension_for(list(job_transports().values()))
    except ImportError:  # an older package: the diagnostics extension
        from mcore_reshard.adapters.vllm.worker import REFIT_EXTENSION

        return REFIT_EXTENSION


def _statuses(llm: Any) -> list[dict]:
    out = []
    for st in llm.collective_rpc("mr_status"):
        out.append(st if isinstance(st, dict) else getattr(st, "__dict__", {"state": f"unreadable: {st!r}"}))
    return out


def engine_healthy(llm: Any) -> str:
    """"" when ``llm`` can be handed to the next test, else why not."""
    try:
        if llm.llm_engine.is_sleeping():
            return "paused (gated)"
        bad = [st for st in _statuses(llm) if st.get("state") != "serving"]
        if bad:
            return f"workers not serving: {bad}"
    except Exception as exc:  # noqa: BLE001 - a dead engine core or worker
        return f"{type(exc).__name__}: {exc}"
    return ""


def refit_pids(engines: Any, pool: Any = None) -> list[int]:
    """Every process that takes part in a refit: each engine's workers, and the trainer pool's
    ranks that are alive."""
    pids = [int(info["pid"]) for llm in engines for info in llm.collective_rpc("mr_rank_info")]
    return pids + [p.pid for p in getattr(pool, "procs", []) if p.is_alive()]


def assert_idle(pids: list[int], settle_s: float = 2.0) -> None:
    """After a failure: once it settled (vLLM's workers poll their queue for a second after each
    call), no thread of ``pids`` uses CPU (``testing.idle``)."""
    from mcore_reshard.testing.idle import busy

    time.sleep(settle_s)
    hot = busy(pids)
    assert hot == {}, f"busy while idle after the failure: {hot}"


def rss_mib(pid: int | None = None) -> float:
    """Resident memory of this process (or ``pid``) and all its children, MiB."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return 0.0
    p = psutil.Process(pid)
    total = 0
    for q in [p, *p.children(recursive=True)]:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


class EngineCache:
    """Running refit engines by (architecture, dtype, tp, enable_ep, direct); an LRU."""

    def __init__(self, max_engines: int = 2, log: Any = None) -> None:
        self.max_engines = max_engines
        self._engines: "OrderedDict[tuple, Any]" = OrderedDict()
        self.started = 0
        self.reused = 0
        self._log = log or (lambda msg: None)

    @staticmethod
    def key(ckpt: Path | str, *, tp: int = 1, dtype: str = "float32", enable_ep: bool = False,
            direct: bool = False, engine_args: Mapping[str, Any] | None = None) -> tuple:
        return (model_key(ckpt), dtype, tp, enable_ep, direct, json.dumps(engine_args or {}, sort_keys=True))

    def get(self, ckpt: Path | str, *, tp: int = 1, dtype: str = "float32", enable_ep: bool = False,
            direct: bool = False, fresh: bool = False, engine_args: Mapping[str, Any] | None = None) -> Any:
        """The running engine of that key, or a new one loaded from ``ckpt`` by vLLM's own
        loader. ``fresh=True``: always a new one (a test that needs vLLM's load of ``ckpt`` as
        its reference), which then stays cached for the next test like any other.
        ``engine_args``: more of vLLM's engine arguments, part of the key (a LoRA policy's
        slots, ``speculative_config``: the LoRA and drafting engines are cached too)."""
        from mcore_reshard.adapters.vllm.engine import start_engine
        from mcore_reshard.adapters.vllm.plugin import BACKEND

        k = self.key(ckpt, tp=tp, dtype=dtype, enable_ep=enable_ep, direct=direct, engine_args=engine_args)
        llm = self._engines.get(k)
        if llm is not None and fresh:
            self._log(f"engine {k[1:]} replaced by a fresh one")
            self.evict(llm)
            llm = None
        if llm is not None:
            why = engine_healthy(llm)
            if not why:
                self._engines.move_to_end(k)
                self.reused += 1
                self._log(f"engine {k[1:]} reused")
                return llm
            self._log(f"engine {k[1:]} not reusable ({why}): stopped")
            self.evict(llm)
        while len(self._engines) >= self.max_engines:
            _, old = self._engines.popitem(last=False)
            self._stop(old)
        t0 = time.monotonic()
        llm = start_engine(str(ckpt), tp=tp, dtype=dtype, enable_ep=enable_ep, direct=direct,
                           worker_extension_cls=engine_extension(), weight_transfer_config={"backend": BACKEND},
                           **dict(engine_args or {}))
        self.started += 1
        self._log(f"engine {k[1:]} started in {time.monotonic() - t0:.1f}s ({len(self._engines) + 1} running)")
        self._engines[k] = llm
        return llm

    def check(self, llm: Any) -> None:
        """After a test: stop ``llm`` if it is not fit for the next one."""
        if any(v is llm for v in self._engines.values()):
            why = engine_healthy(llm)
            if why:
                self._log(f"engine left unusable ({why}): stopped")
                self.evict(llm)

    def evict(self, llm: Any) -> None:
        for k, v in list(self._engines.items()):
            if v is llm:
                del self._engines[k]
        self._stop(llm)

    @staticmethod
    def _stop(llm: Any) -> None:
        from mcore_reshard.adapters.vllm.engine import stop_engine

        try:
            stop_engine(llm)
        except Exception:  # noqa: BLE001 - best effort
            pass

    def close(self) -> None:
        while self._engines:
            _, llm = self._engines.popitem()
            self._stop(llm)


# --------------------------------------------------------------------------- trainer pools


def setup_key(setup: Any) -> str:
    """A ``TrainerSetup`` less its rendezvous port (every field's repr: frozen dataclasses)."""
    from dataclasses import fields

    parts = [f"{f.name}={getattr(setup, f.name)!r}" for f in fields(setup) if f.name != "port"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def short(obj: Any) -> str:
    """A dataclass's repr with only the fields that differ from their defaults."""
    from dataclasses import MISSING, fields, is_dataclass

    if not is_dataclass(obj):
        return repr(obj)
    parts = []
    for f in fields(obj):
        v = getattr(obj, f.name)
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)  # type: ignore[misc]
        if default is MISSING or v != default:
            parts.append(f"{f.name}={v!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


def _pool_healthy(pool: Any) -> bool:
    try:
        if pool.dead():
            return False
    except Exception:  # noqa: BLE001
        return False
    pending = getattr(pool, "_in_flight", None)
    if pending is not None and not getattr(pending, "done", True):
        return False
    return True


class _Leased:
    """A cached pool handed to one ``local_cluster``: everything is the pool's, except
    ``close``: while ``keep`` is set (the cluster starting or closing) it gives the pool back
    to the cache; inside the test (``restart_trainers``) it really closes it."""

    def __init__(self, cache: "PoolCache", key: str, pool: Any) -> None:
        self.__dict__.update(_cache=cache, _key=key, _pool=pool, keep=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_pool"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "keep":
            self.__dict__["keep"] = value
        else:
            setattr(self.__dict__["_pool"], name, value)

    def close(self) -> None:
        cache, key, pool = self.__dict__["_cache"], self.__dict__["_key"], self.__dict__["_pool"]
        if self.__dict__["keep"]:
            cache.release(key, pool)
        else:
            cache.discard(pool)


class PoolCache:
    """Idle trainer pools by ``setup_key``; at most ``max_idle`` kept (LRU)."""

    def __init__(self, max_idle: int = 3, log: Any = None) -> None:
        self.max_idle = max_idle
        self._idle: "OrderedDict[str, Any]" = OrderedDict()
        self.started = 0
        self.reused = 0
        self._log = log or (lambda msg: None)

    def lease(self, setup: Any, start: Any) -> _Leased:
        """The idle pool for ``setup`` if one is healthy, else ``start(setup)`` (LocalTrainerGroup)."""
        key = setup_key(setup)
        pool = self._idle.pop(key, None)
        if pool is not None and not _pool_healthy(pool):
            self.discard(pool)
            pool = None
        if pool is None:
            t0 = time.monotonic()
            pool = start(setup)
            self.started += 1
            self._log(f"trainer pool {short(setup.par)} {setup.spec.dtype} started in {time.monotonic() - t0:.1f}s")
        else:
            self.reused += 1
            self._log(f"trainer pool {short(setup.par)} {setup.spec.dtype} reused")
        return _Leased(self, key, pool)

    def release(self, key: str, pool: Any) -> None:
        if not _pool_healthy(pool) or key in self._idle:
            self.discard(pool)
            return
        self._idle[key] = pool
        while len(self._idle) > self.max_idle:
            _, old = self._idle.popitem(last=False)
            self.discard(old)

    def adopt(self, setup: Any, pool: Any) -> _Leased:
        """A pool a test started itself (``restart_trainers``), handed to the cache on exit."""
        return _Leased(self, setup_key(setup), pool)

    def discard(self, pool: Any) -> None:
        for k, v in list(self._idle.items()):
            if v is pool:
                del self._idle[k]
        try:
            pool.close()
        except Exception:  # noqa: BLE001 - best effort
            pass

    def close(self) -> None:
        while self._idle:
            _, pool = self._idle.popitem()
            self.discard(pool)


#: The session's pools (``conftest.py`` closes them at the end).
POOLS = PoolCache()


@contextmanager
def cluster(*args: Any, **kwargs: Any) -> Iterator[Any]:
    """``mcore_reshard.jobs.refit.local_cluster(*args, **kwargs)`` with its trainer pool from
    ``POOLS``. Pass ``engines=`` (from ``EngineCache``) so that it starts no engine either."""
    import mcore_reshard.training.pool as trainer_mod
    from mcore_reshard.jobs.refit import local_cluster

    real = trainer_mod.LocalTrainerGroup
    cm = local_cluster(*args, **kwargs)
    trainer_mod.LocalTrainerGroup = lambda setup: POOLS.lease(setup, real)  # type: ignore[assignment] - only while it starts
    try:
        c = cm.__enter__()
    finally:
        trainer_mod.LocalTrainerGroup = real
    if isinstance(c.pool, _Leased):
        c.pool.keep = False  # restart_trainers in the test: a real close, then a new pool
    try:
        yield c
    except BaseException:
        _on_exit(c)
        if not cm.__exit__(*sys.exc_info()):
            raise
    else:
        _on_exit(c)
        cm.__exit__(None, None, None)


def _on_exit(c: Any) -> None:
    if isinstance(c.pool, _Leased):
        c.pool.keep = True
    elif c.pool is not None and c.setup is not None:  # restarted in the test: keep the new one
        c.pool = POOLS.adopt(c.setup, c.pool)


def trained_checkpoint(c: Any, spec: Any, like: Path, out: Path) -> Path:
    """The trainers of cluster ``c`` as an HF checkpoint now: every rank's pieces assembled into
    the canonical tensors (the table's shapes reshaped back to the checkpoint's), beside
    ``like``'s config -- what a fresh engine loads to compare with a refitted one."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from mcore_reshard.infra.checkpoint import checkpoint_form
    from mcore_reshard.transport.views import local_view

    local = c.pool.local_tensors().wait()
    canon = {n: torch.empty(shape, dtype=torch.float32) for n, (shape, _) in spec.tensor_table().items()}
    for p in c.driver.src.params:
        for pc in p.pieces:
            box = tuple(slice(o, o + n) for o, n in zip(pc.box.offsets, pc.box.sizes))
            canon[pc.canonical][box] = local_view(local[p.rank][p.name], pc.view)
    out.mkdir()
    for f in Path(like).glob("*.json"):  # the config (a VLM's tokenizer and processor too)
        if not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
    save_file({n: t.contiguous() for n, t in checkpoint_form(canon, spec).items()}, str(out / "model.safetensors"))
    return out

