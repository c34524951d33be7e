"""Shared fixtures, and the order the live tests run in.

What the live tests start is shared through session caches (``support/live.py``,
``support/megatron.py``), keyed by what makes one differ from another:

- ``ckpt_cache``: tiny HF checkpoints by (family, dtype, seed, overrides);
- ``shared_engine(ckpt, tp=, dtype=, enable_ep=, direct=)``: vLLM refit engines by (model
  architecture, dtype, TP, EP, apply mode), at most ``MR_TEST_MAX_ENGINES`` (default 2)
  running; one a test left paused, not serving or dead is stopped, never reused
  (``class_engine``: the same, checked after a test class);
- ``support.live.cluster``: ``local_cluster`` over trainer pools cached by their setup
  (checkpoint, dtype, megatron layout, training settings), given back after each use unless
  a rank died; ``restart_trainers`` still starts a fresh pool from the checkpoint;
- ``support.megatron.run_world``: megatron jobs on warm rank processes by world size.

Tests that kill a rank or an engine start their own (see each module). Markers:
``slow`` = starts something (processes, worlds, engines, a server, Ray); ``heavy`` = plans a
full-size model in-process (10-60 s of CPU, starts nothing). ``make test-fast`` runs
``-m "not slow and not heavy"``.

Order: modules that start nothing run first (in file order), then the live modules grouped
by what they share (``LIVE_ORDER``), so that a cached engine or pool is reused while it is
warm and released when the group ends.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

# This process keeps what the tests planned alive (the rules' and planner's caches hold the
# layouts of full-size models: over two million objects by the end of make test-fast), so
# every full collection of the cycle collector walks them all: 0.2-0.6 s each, a fifth of make
# test-fast's CPU time. Full collections here wait for 100 times the default number of
# younger ones (young cycles are still collected as often as ever; the planner pauses the
# collector while it plans). Only this process: the ones it spawns start with the default.
gc.set_threshold(700, 10, 1000)

# Every process of the session shares these two cores with a dozen others (ranks, engine
# cores, workers, the background runs): libgomp's threads sleep as soon as they wait, instead
# of spinning for milliseconds after each parallel region (read when libgomp loads, with torch;
# the processes the session starts inherit it). About a sixth of the live modules' CPU time
# was such spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# For the same reason vLLM's shared-memory queue readers (every engine core and worker) spin
# 50 ms after a message instead of vLLM's 1 s (``mcore_reshard/adapters/vllm/spin.py``): a
# quarter of the live refit tests' CPU time was that spinning; a decode loop's messages come
# milliseconds apart, so it still spins between them.
os.environ.setdefault("MCORE_RESHARD_VLLM_SPIN_S", "0.05")
# The few functions vLLM and megatron-core wrap in ``torch.compile`` even in eager engines --
# vLLM's prompt-logprob gather and its TP>1 embedding mask, megatron-core's fused GLU -- run
# as plain eager code (read when torch loads; the processes the session starts inherit it).
# Each process that first calls one traces it and loads it from inductor's disk cache, a
# compiler probe subprocess included: about 2 CPU-seconds, in some 140 processes per make test
# (engine workers, training ranks), over a tenth of the suite's CPU. The tests compare vLLM
# against vLLM bit for bit and trainers against vLLM within fp32's bound, which eager code
# meets as well; the runs that stand for a user's (the embedded GRPO run) drop the variable.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mcore_reshard.infra.procs import ENV as _FAST_START  # noqa: E402

# The training ranks and vLLM engines this session starts (and the servers and CLI runs it
# starts) come from a fork server that imported torch, megatron-core and vLLM once, and engines
# fork their workers: an engine starts in 2-3 s instead of 17-20 s, a training rank without its
# 5 s of imports (``mcore_reshard/infra/procs.py``). ``MCORE_RESHARD_FAST_START=0`` turns it off.
os.environ.setdefault(_FAST_START, "1")

from support import live as _live  # noqa: E402
from support import megatron as _megatron  # noqa: E402
from support.background import BACKGROUND  # noqa: E402

#: Live modules, in the order they run after every other module: grouped by the engines,
#: trainer pools and megatron worlds they share. Each entry: (module, what it shares).
LIVE_ORDER: list[tuple[str, frozenset[str]]] = [
    ("test_transport", frozenset()),
    ("test_relays", frozenset()),
    ("test_mixed_dtype", frozenset()),
    ("test_megatron_live", frozenset({"megatron"})),
    ("test_deepseek_megatron", frozenset({"megatron"})),
    ("test_megatron_train", frozenset({"megatron"})),
    ("test_fp8", frozenset({"megatron"})),
    # fp32 tiny MoE (seed 7): engines TP1 and TP2, the TP2xEP2 trainer pool
    ("test_endpoints", frozenset({"megatron", "live"})),
    # a LoRA TP2 engine (cached), which vLLM's trainer API then refits in a second session; the
    # fp32 tiny MoE TP1 engine above and an MTP-drafting engine (cached) through the trainer API,
    # then test_mtp_vllm's driver on the same drafting engine (nothing stops an engine between:
    # vLLM's metrics registry is per process, and the acceptance check reads it)
    ("test_lora_refit", frozenset({"megatron", "live"})),
    ("test_trainer_api", frozenset({"megatron", "live"})),
    ("test_mtp_vllm", frozenset({"live"})),
    # a bf16 block-FP8 tiny MoE TP2 engine (CPUs with AMX only): vLLM's own load, then the
    # applier's and the trainer API's refits
    ("test_fp8_live", frozenset({"megatron", "live"})),
    ("test_colocated", frozenset({"live"})),
    ("test_refit_layouts", frozenset({"live"})),
    # a DTensor (FSDP2 + TP) policy through vLLM's trainer API, into the dense qwen2 TP1 engine
    ("test_dtensor_source", frozenset({"live"})),
    ("test_refit_e2e", frozenset({"live"})),
    # the fp32 tiny MoE TP2 and TP1 engines above, then dense TP1 / TP2 direct / MoE TP2xEP2
    ("test_vllm_live", frozenset({"live"})),
    # bf16 tiny MoE (seed 13): the TP2xEP2 trainer pool
    ("test_refit_bf16", frozenset({"live"})),
    ("test_faults", frozenset({"live"})),
    # the same engine and pool, refit while generating
    ("test_overlap", frozenset({"live"})),
    # a tied fp32 dense TP2 engine and a bf16 TP1 one (cached), with pools of their own
    ("test_canary", frozenset({"engines"})),
    # tiny DeepSeek-V3 engines, q_lora TP1 and plain q TP2 (engines only: the pools above close)
    ("test_deepseek_refit", frozenset({"engines"})),
    ("test_deepseek_vllm", frozenset({"engines"})),
    # tiny gpt-oss and GLM-4.5: their own engines (cached, fresh) and trainer pools
    ("test_family_refit", frozenset({"engines"})),
    # Megatron-FSDP policies: fresh engines (cached) and their own trainer pools
    ("test_megatron_fsdp", frozenset({"engines"})),
    # tiny LLaVA: fresh engines (cached) and a TP2 trainer pool of its own
    ("test_vlm_refit", frozenset({"engines"})),
    # own engines and pools only (nothing of the above is reused)
    ("test_process_starts", frozenset()),
    ("test_http_server", frozenset()),
    ("test_grpo_ray", frozenset()),
]
#: Groups that keep the cached engines: ``live`` (engines and trainer pools) and ``engines``.
_ENGINE_GROUPS = frozenset({"live", "engines"})
_RANK = {name: i + 1 for i, (name, _) in enumerate(LIVE_ORDER)}
_SHARES = dict(LIVE_ORDER)

_STATS: dict = {"log": []}


def _log(msg: str) -> None:
    _STATS["log"].append(f"{time.strftime('%H:%M:%S')} {msg}")


_live.POOLS._log = _log
BACKGROUND.log = _log


#: Single cases of parametrized tests that plan a full-size model (marked ``heavy`` here: their
#: parameter lists build the ids from plain tuples).
HEAVY_CASES = (
    "test_bad_input.py::test_plan_bad_input[refit.buffer_bytes=65536]",  # 15M transfers before it says no
    "test_cli.py::test_bad_input_is_one_line_exit_2[args5-destination needs]",  # Qwen3-235B's layouts
)


def _module(item: pytest.Item) -> str:
    return Path(str(item.fspath)).stem


def _job_of(item: pytest.Item) -> tuple | None:
    """The background job this test asserts on (its module's ``BACKGROUND_JOBS``), if any."""
    jobs = getattr(item.module, "BACKGROUND_JOBS", None) or {}
    return jobs.get(getattr(item, "originalname", item.name))


def _awaits_job(item: pytest.Item) -> bool:
    """Tests that wait for a background job run after their module's other tests: a late job
    (``LATE_FROM``) is then still running while those run."""
    return _job_of(item) is not None


def _plans_key(item: pytest.Item | None) -> str | None:
    """The ``plans(key)`` marker's key: tests that plan the same full-size layouts."""
    mark = item.get_closest_marker("plans") if item is not None else None
    return mark.args[0] if mark is not None else None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks ``HEAVY_CASES``. Order: modules that start nothing first, in file order; then
    ``LIVE_ORDER``. Within a module the file's order is kept (some modules depend on it),
    except that the tests that wait for a background job run after the others
    (``_awaits_job``), and that tests of one ``plans(key)`` run together where the first of them is: a
    full-size plan (2-7 s of CPU) that a doc command and a recipe's dry run both make is then
    made once (``pytest_runtest_teardown`` clears the caches after the last of them)."""
    for item in items:
        if any(item.nodeid.endswith(case) for case in HEAVY_CASES):
            item.add_marker(pytest.mark.heavy)
    index = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (_RANK.get(_module(it), 0), _awaits_job(it), index[id(it)]))
    first: dict[str, int] = {}  # key -> where its first test is
    at: dict[int, tuple[int, int]] = {}
    for i, item in enumerate(items):
        key = _plans_key(item)
        at[id(item)] = (i if key is None else first.setdefault(key, i), i)
    items.sort(key=lambda it: at[id(it)])


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Start, on the otherwise idle core while the tests that start nothing run: the
    background jobs of the selected tests (a module's ``BACKGROUND_JOBS``: the GRPO CLI runs)
    and, when this run has megatron tests, the warm megatron worlds (their ranks import
    megatron-core)."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        job = _job_of(item)
        if job is not None:
            BACKGROUND.add(*job, late=job[0] in getattr(item.module, "LATE_JOBS", ()))
    mods = {_module(it) for it in session.items if it.get_closest_marker("slow") is not None}

    def start() -> None:
        if os.environ.get("MR_TEST_NO_BACKGROUND") != "1":
            BACKGROUND.start()
        if os.environ.get("MR_TEST_COLD_WORLDS") == "1":
            return
        if any("megatron" in _SHARES.get(m, ()) for m in mods):
            sizes = sorted({2, *([1, 4] if "test_megatron_train" in mods else [])})
            _megatron.prestart(sizes)
            _log(f"warm megatron worlds of {sizes} rank(s) starting in the background")

    _PENDING.append(start)


#: The module from which on (in ``LIVE_ORDER``) the background's late jobs may run (a module's
#: ``LATE_JOBS``): the modules from here on start their own engines, servers and clusters one
#: test at a time and leave a core idle for much of it, while the live modules before them keep
#: both busy (a job there takes its share of a contended core from them).
LATE_FROM = "test_process_starts"

#: Modules whose tests check that a bad input starts no process (they compare this process's
#: children before and after): the background starts once the first test outside them runs.
_QUIET = {"test_bad_input"}
_PENDING: list = []


def pytest_runtest_setup(item: pytest.Item) -> None:
    module = _module(item)
    if _PENDING and module not in _QUIET:
        _PENDING.pop()()
    if _RANK.get(module, 0) >= _RANK[LATE_FROM]:
        BACKGROUND.start_late()
    if _STATS.get("module") != module:
        _STATS["module"] = module
        _log(f"module {module}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Release what a group of modules shared once the next test is outside the group (after
    this test's own fixtures are torn down)."""
    yield
    key = _plans_key(item)
    if key is not None and _plans_key(nextitem) != key:
        from mcore_reshard.plan.cache import clear_plan_cache

        clear_plan_cache()  # full-size plans hold hundreds of MB: not kept for the next tests
    here = _SHARES.get(_module(item), frozenset())
    after = _SHARES.get(_module(nextitem), frozenset()) if nextitem is not None else frozenset()
    if "megatron" in here and "megatron" not in after:
        _megatron.close_all()
        _log("warm megatron worlds closed")
    if "live" in here and "live" not in after:
        _live.POOLS.close()
        _log("trainer pools closed")
    if here & _ENGINE_GROUPS and not after & _ENGINE_GROUPS:
        cache = _ENGINES.get("cache")
        if cache is not None:
            cache.close()
        _log("cached engines closed")


_ENGINES: dict[str, _live.EngineCache] = {}


@pytest.fixture(scope="session")
def ckpt_cache(tmp_path_factory: pytest.TempPathFactory) -> _live.Checkpoints:
    """Tiny HF checkpoints by (family, dtype, seed, overrides), written once per session."""
    return _live.Checkpoints(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="session")
def engine_cache():
    cache = _live.EngineCache(max_engines=int(os.environ.get("MR_TEST_MAX_ENGINES", "2")), log=_log)
    _ENGINES["cache"] = cache
    yield cache
    cache.close()


def _checked_engines(cache: _live.EngineCache):
    """A getter of shared engines, and once its user is done: stop each one it left unusable."""
    used: list = []

    def get(ckpt, **kw):
        llm = cache.get(ckpt, **kw)
        used.append(llm)
        return llm

    yield get
    for llm in used:
        cache.check(llm)


@pytest.fixture
def shared_engine(engine_cache):
    """``shared_engine(ckpt, tp=1, dtype="float32", enable_ep=False, direct=False)``: a running
    refit engine (worker extension + ``mcore_reshard`` backend) of that architecture, shared
    with other tests; stopped after this test if the test left it unusable."""
    yield from _checked_engines(engine_cache)


@pytest.fixture(scope="class")
def class_engine(engine_cache):
    """``shared_engine`` for a test class whose tests build on each other's refits: checked
    once, after the class."""
    yield from _checked_engines(engine_cache)


@pytest.fixture(scope="session", autouse=True)
def _close_shared_resources():
    yield
    _live.POOLS.close()
    _megatron.close_all()
    BACKGROUND.close()


def _machine_busy_s() -> float:
    """CPU-seconds every core of this machine has spent busy since boot (psutil's
    ``cpu_times``: everything but idle and I/O wait)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With ``MR_TEST_LOG_RESOURCES=1``: each test's wall time and the machine's busy CPU
    during it (every process: the test's, the background jobs', the machine's own)."""
    if os.environ.get("MR_TEST_LOG_RESOURCES") != "1":
        yield
        return
    t0, c0 = time.monotonic(), _machine_busy_s()
    yield
    _STATS.setdefault("tests", []).append((_machine_busy_s() - c0, time.monotonic() - t0, item.nodeid))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    cache = _ENGINES.get("cache")
    parts = []
    if cache is not None and (cache.started or cache.reused):
        parts.append(f"cached engines: {cache.started} started, {cache.reused} reuses")
    if _live.POOLS.started or _live.POOLS.reused:
        parts.append(f"trainer pools: {_live.POOLS.started} started, {_live.POOLS.reused} reuses")
    jobs = _megatron.stats()
    if jobs["jobs"]:
        parts.append(f"megatron jobs: {jobs['jobs']} on {jobs['worlds']} warm world(s)")
    if parts:
        terminalreporter.write_sep("-", "shared test resources")
        terminalreporter.write_line("; ".join(parts))
        if os.environ.get("MR_TEST_LOG_RESOURCES") == "1":
            for line in _STATS["log"]:
                terminalreporter.write_line(line)
    if _STATS.get("tests"):
        terminalreporter.write_sep("-", "machine CPU-seconds busy during each test (top 40; MR_TEST_LOG_RESOURCES=1)")
        for busy, wall, nodeid in sorted(_STATS["tests"], reverse=True)[:40]:
            terminalreporter.write_line(f"{busy:7.1f} CPU-s {wall:6.1f} s  {nodeid}")
