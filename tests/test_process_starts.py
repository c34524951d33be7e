"""How the local job's processes begin: spawned (the default), or forked by the fork server of
``MCORE_RESHARD_FAST_START=1`` (``mcore_reshard/infra/procs.py``, which this test session turns on).
The same refit runs either way, to the same served weights; each test checks where every
training rank, engine core and vLLM worker came from, so neither path is taken by accident.
Either way, a built training rank's state is out of the garbage collector's view, and a
fork-server child starts with what the server imported out of it (``gc.freeze``)."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import psutil
import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import prompt_logprobs
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.jobs.refit import local_cluster
from mcore_reshard.layout import load_model_spec
from mcore_reshard.infra import procs
from mcore_reshard.infra.procs import ENV
from mcore_reshard.settings.policy import RefitConfig
from support.background import BACKGROUND

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300]


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


@dataclass(frozen=True)
class _Walked:
    """A ``RankTask``: whether the collector still walks the training rank object or its
    endpoint (in no generation once ``trainer_rank`` froze them)."""

    def run(self, rank) -> bool:
        walked = {id(o) for o in gc.get_objects()}
        return any(id(x) in walked for x in (rank, rank.endpoint))


def _refit_and_list_processes(ckpt_cache) -> tuple[list, dict[int, tuple[str, int]], set[int]]:
    """One verified refit of a TP1 trainer into a TP2 engine; (served logprobs, {pid: (its
    command line, its parent's pid)} of every process started meanwhile, this process's fork
    servers). The trainer's state is checked out of the collector's view on the way. The
    session's background jobs (``support.background``: GRPO runs, which may start processes
    meanwhile) and what they start are not this refit's."""
    ckpt = ckpt_cache.get(seed=21)
    spec = load_model_spec(ckpt, dtype="float32")
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    with local_cluster(spec, ckpt, MegatronParallel(), VllmParallel(tp=2), RefitConfig(timeout_s=60.0)) as c:
        m = c.refit_once()
        assert m.verified and m.bytes_moved == m.bytes_min
        assert c.driver.trainers.run(_Walked()).wait() == [False]
        served = prompt_logprobs(c.engines[0], TOKENS)
        new, servers = {}, set()
        jobs = {proc.pid for proc in BACKGROUND.procs}
        for p in me.children(recursive=True):
            try:
                cmd, ppid = _cmdline(p), p.ppid()
                if p.pid in jobs or any(a.pid in jobs for a in p.parents()):
                    continue
            except psutil.Error:
                continue
            if ppid == me.pid and "forkserver" in cmd:
                servers.add(p.pid)
            elif p.pid not in before:
                new[p.pid] = (cmd, ppid)
    return served, new, servers


@pytest.fixture(scope="module")
def spawned(ckpt_cache):
    """The refit with the fast start off (the default): what both tests compare against."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "0")
        return _refit_and_list_processes(ckpt_cache)


def test_default_starts_spawn_every_process(spawned):
    _, procs, servers = spawned
    me = psutil.Process().pid
    # the training rank and the engine core are this process's own children (vLLM retitles its
    # processes, so the command line shows spawn only for the rank), the 2 workers the core's
    direct = {pid for pid, (cmd, ppid) in procs.items() if ppid == me and "resource_tracker" not in cmd}
    assert len(direct) >= 2 and any("spawn_main" in procs[pid][0] for pid in direct), procs
    assert len({pid for pid, (_, ppid) in procs.items() if ppid in direct}) >= 2, procs
    assert not any(ppid in servers for _, ppid in procs.values()), procs


def test_fast_start_forks_from_one_server_and_serves_the_same(ckpt_cache, monkeypatch, spawned):
    monkeypatch.setenv(ENV, "1")
    served, procs, servers = _refit_and_list_processes(ckpt_cache)
    me = psutil.Process().pid
    assert len(servers) == 1, servers  # one fork server per process, whatever it started
    from_server = {pid for pid, (_, ppid) in procs.items() if ppid in servers}
    # the training rank and the engine core come from the fork server, the 2 workers are
    # forked by the core: no process started an interpreter of its own
    assert len(from_server) >= 2, procs
    assert len({pid for pid, (_, ppid) in procs.items() if ppid in from_server}) >= 2, procs
    assert not any(ppid == me and "resource_tracker" not in cmd for cmd, ppid in procs.values()), procs
    assert not any("spawn_main" in cmd for cmd, _ in procs.values()), procs
    assert served == spawned[0]  # fp32, the same checkpoint refit into TP2: bit for bit


def _freeze_count(q) -> None:
    q.put(gc.get_freeze_count())


def test_a_fork_server_child_starts_with_the_servers_imports_frozen():
    """The server imported torch, megatron-core and vLLM (hundreds of thousands of objects) and
    froze none of them: the child does, before it runs anything."""
    ctx = procs.context()
    q = ctx.Queue()
    child = ctx.Process(target=_freeze_count, args=(q,))
    child.start()
    try:
        assert q.get(timeout=120) > 100_000
    finally:
        child.join(30)
    assert child.exitcode == 0


def _where() -> tuple[bool, int]:
    import os

    return procs.in_child(), os.getppid()


def test_vllms_model_inspection_runs_in_a_fork_server_child(monkeypatch, tmp_path):
    """vLLM inspects a model class it has not cached in a child process: under the fast start a
    fork-server child (no new interpreter importing vLLM again), whose answer is vLLM's own
    (``_ModelInfo.from_model_cls`` here, in this process) and lands in vLLM's cache."""
    import json
    import subprocess

    from vllm.model_executor.models import registry

    from mcore_reshard.adapters.vllm import fast_start

    monkeypatch.setenv(ENV, "1")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    fast_start.install()
    assert registry._run_in_subprocess is fast_start._run_in_subprocess
    in_child, parent = fast_start._run_in_subprocess(_where)
    assert in_child and "forkserver" in _cmdline(psutil.Process(parent))

    def no_interpreter(*args, **kwargs):
        raise AssertionError(f"a new interpreter was started: {args[0]}")

    monkeypatch.setattr(subprocess, "run", no_interpreter)
    lazy = registry._LazyRegisteredModel("vllm.model_executor.models.qwen2", "Qwen2ForCausalLM")
    got = lazy.inspect_model_cls()
    assert got == registry._ModelInfo.from_model_cls(lazy.load_model_cls())
    (cached,) = (tmp_path / "modelinfos").glob("*Qwen2ForCausalLM.json")
    assert json.loads(cached.read_text())["modelinfo"]["architecture"] == "Qwen2ForCausalLM"
