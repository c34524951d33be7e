"""GRPO on Ray, for real: megatron-core trainer actors and a vLLM engine actor, a refit after
every step -- on an embedded local cluster (the default, interrupted by Ctrl-C) and on a
simulated two-node cluster (``ray.cluster_utils.Cluster``: placement, a trainer actor's death).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import pytest

psutil = pytest.importorskip("psutil")

from support.background import BACKGROUND, track  # noqa: E402
from mcore_reshard.infra import procs  # noqa: E402
from mcore_reshard.adapters.vllm import spin  # noqa: E402

pytestmark = pytest.mark.slow  # every test runs GRPO: megatron ranks, a vLLM engine, Ray

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo-tiny-moe-cpu.yaml"
ASYNC_RECIPE = ROOT / "recipes" / "grpo-tiny-moe-cpu-async.yaml"
LORA_RECIPE = ROOT / "recipes" / "grpo-tiny-lora-cpu.yaml"
FSDP_RECIPE = ROOT / "recipes" / "grpo-tiny-fsdp-cpu.yaml"
DTENSOR_RECIPE = ROOT / "recipes" / "grpo-tiny-dtensor-cpu.yaml"
LLAVA_RECIPE = ROOT / "recipes" / "grpo-tiny-llava-cpu.yaml"


def _run_processes() -> set[int]:
    return set(psutil.pids())


def _marked(key: str, value: str) -> list[str]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(key) == value:
                out.append(" ".join(p.cmdline()))
        except psutil.Error:
            pass
    return out


def _engine_starts(key: str, value: str) -> set[str]:
    """How a run's engine actors (``key=value`` in their environment) started vLLM's engine
    core, from their child processes: "spawned" (vLLM's own rule on a CPU platform; vLLM titles
    the child ``VLLM::EngineCore``) or "fork server" (``MCORE_RESHARD_FAST_START=1``: the
    actor's own fork server, whose children -- the engine core and its workers -- keep its
    command line)."""
    out = set()
    for p in psutil.process_iter():
        try:
            if p.environ().get(key) != value or not " ".join(p.cmdline()).startswith("ray::EngineActor"):
                continue
            children = [" ".join(c.cmdline()) for c in p.children()]
        except psutil.Error:
            continue
        out |= {"spawned" for c in children if c.startswith("VLLM::EngineCore")}
        out |= {"fork server" for c in children if "multiprocessing.forkserver" in c}
    return out


def _survivors(before: set[int], key: str, value: str, grace_s: float = 30.0) -> dict[int, str]:
    """Processes of this run -- started since ``before``, with ``key=value`` in their
    environment (inherited by everything the run started, not by other users of the machine)
    -- still alive after ``grace_s``; a cluster's own daemons and the idle workers Ray keeps
    in its pool excepted."""
    deadline = time.monotonic() + grace_s
    while True:
        left = {}
        for pid in _run_processes() - before:
            try:
                p = psutil.Process(pid)
                if p.status() == psutil.STATUS_ZOMBIE or p.environ().get(key) != value:
                    continue
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if not any(k in cmd for k in ("ray::IDLE", "raylet", "gcs_server")):
                left[pid] = cmd
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _at_minimum(s: dict) -> bool:
    """A step's refit moved what the plan promises: a full refit the minimum; a delta (every
    refit after the first, ``refit.delta=auto``) at most the full refit's data, plus headers."""
    from mcore_reshard.refit.driver import bytes_at_minimum

    return s["refit_bytes_min"] > 0 and bytes_at_minimum(s["refit_bytes_moved"], s["refit_bytes_min"],
                                                         s["refit_bytes_full"], s["refit_bytes_headers"],
                                                         s["refit_delta"])


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _embedded_run(workdir: Path) -> dict:
    """``mcore-reshard grpo RECIPE`` (= ``make demo``: an embedded Ray cluster) until 8 steps are
    logged, then Ctrl-C; returns what it printed, logged and left behind."""
    home = workdir / "home"
    home.mkdir()
    logs = workdir / "logs"
    metrics = logs / "metrics.jsonl"
    tmp_before = set(Path("/tmp").glob("mr_ray_*"))
    before = set(_run_processes())
    marker = f"grpo-{os.getpid()}-{time.time()}"
    # ``make demo`` as a user runs it: vLLM's own process starts in the engine actor, its
    # readers' spin, libgomp's waits and ``torch.compile`` (the other runs here take the
    # session's fast start and its settings of those: conftest.py). vLLM's cache stays where it
    # was, as on a user's second run (under the new HOME vLLM would inspect the model in a
    # subprocess again, 9 CPU-s).
    from vllm import envs as vllm_envs  # vLLM's own rule for where its cache is (the session imports vLLM anyway)

    env = {**os.environ, "HOME": str(home), "MR_TEST_RUN": marker, procs.ENV: "0",
           "VLLM_CACHE_ROOT": vllm_envs.VLLM_CACHE_ROOT}
    env.pop(spin.ENV, None)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("TORCHDYNAMO_DISABLE", None)
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_AUTH_MODE", None)
    cmd = [sys.executable, "-m", "mcore_reshard.cli", "grpo", str(RECIPE), "grpo.max_num_steps=50",
           f"logger.log_dir={logs}"]
    proc = track(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 400
        while len(_lines(metrics)) < 8:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "8 steps did not finish within 400 s"
            time.sleep(0.5)
        running = _marked("MR_TEST_RUN", marker)  # the survivor check below sees the run's processes
        assert sum("Actor" in c for c in running) >= 3 and len(running) >= 4, running  # 2 trainers, 1 engine
        assert _engine_starts("MR_TEST_RUN", marker) == {"spawned"}  # vLLM's own rule
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    png = logs / "grpo.png"
    return dict(returncode=proc.returncode, out=out, err=err, steps=_lines(metrics),
                png=png.read_bytes()[:8] if png.exists() else None,
                survivors=_survivors(before, "MR_TEST_RUN", marker), home_ray=(home / ".ray").exists(),
                tmp_before=tmp_before, tmp_after=set(Path("/tmp").glob("mr_ray_*")))


def test_embedded_run_learns_every_refit_verified_and_ctrl_c_stops_it():
    """The default path (``mcore-reshard grpo RECIPE`` = ``make demo``: an embedded Ray
    cluster) runs 8+ steps and is interrupted (Ctrl-C):

    * every refit verified (checksums every step, ``verify=full`` every 4th), bytes moved equal
      the minimum, ``token_mult_prob_error`` at fp32's bound, NeMo RL's timing keys;
    * the policy learns: reward rises far above a random policy's;
    * Ctrl-C: exit 130 after a clean shutdown, the metrics and plot written, every process of
      the run gone, no Ray token written to the home directory (token auth runs on a per-job
      token in the environment), no Ray session files left in /tmp.

    The run itself starts in the background when the session starts (``BACKGROUND_JOBS``).
    """
    r = BACKGROUND.result("grpo-embedded", _embedded_run)
    err, out = r["err"], r["out"]
    assert r["returncode"] == 130, err[-2000:]
    assert "interrupted" in err
    steps = r["steps"]
    assert 8 <= len(steps) < 50 and [s["step"] for s in steps] == list(range(len(steps)))
    assert r["png"] == b"\x89PNG\r\n\x1a\n" and "plot:" in out

    for s in steps:
        assert s["refit_verified"] is True
        assert _at_minimum(s)
        assert 1.0 <= s["token_mult_prob_error"] <= 1.001  # fp32 on both sides
        assert set(s["timing"]) >= {"generation", "logprob_inference", "policy_training", "refit", "total"}
    assert [s["refit_full_verified"] for s in steps] == [(i + 1) % 4 == 0 for i in range(len(steps))]

    # Learning: a random policy scores target_ids / vocab = 0.125 per token. The mean of a
    # step's 128 sampled tokens has a std of about sqrt(0.125 * 0.875 / 128) = 0.03 under it,
    # so +0.2 is over six standard deviations: the rise is the policy's, not sampling noise.
    rewards = [s["reward"] for s in steps[:8]]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2
    assert sum(rewards[-2:]) / 2 > 0.125 + 0.2

    assert not r["survivors"], "processes survived the interrupted run"
    assert not r["home_ray"]  # (vLLM and matplotlib keep their caches under ~/.cache, ~/.config)
    assert r["tmp_after"] == r["tmp_before"]


def _colocated_run(workdir: Path) -> dict:
    """``mcore-reshard grpo RECIPE`` colocated for two steps; what it logged, and the shared-
    memory segments before and after."""
    from mcore_reshard.transport.shm import PREFIX, SHM_DIR

    logs = workdir / "logs"
    segments = set(Path(SHM_DIR).glob(PREFIX + "*"))
    cmd = [sys.executable, "-m", "mcore_reshard.cli", "grpo", str(RECIPE), "policy.generation.colocated.enabled=true",
           "cluster.gpus_per_node=2", "grpo.max_num_steps=2", "grpo.verify_full_every_n_steps=2",
           f"logger.log_dir={logs}"]
    return dict(_cli(cmd, logs, 400), segments_before=segments, segments_after=set(Path(SHM_DIR).glob(PREFIX + "*")))


def _cli(cmd: list[str], logs: Path, timeout_s: float) -> dict:
    """Run a CLI command to its end (killed past ``timeout_s``): exit code, stderr, logged steps."""
    proc = track(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    return dict(returncode=proc.returncode, stderr=err, steps=_lines(logs / "metrics.jsonl"))


def test_colocated_run_keeps_same_device_bytes_off_the_group():
    """``policy.generation.colocated.enabled``: training rank i and vLLM worker i share device
    slot i (2 trainers, 2 engines of TP1). Every refit of the run is verified at the minimum
    bytes, part of them through shared memory (trainer i -> worker i), part over the group
    (the other trainer's experts), ``verify=full`` passes, and no segment is left behind.
    The run starts in the background when the session starts (``BACKGROUND_JOBS``)."""
    r = BACKGROUND.result("grpo-colocated", _colocated_run)
    assert r["returncode"] == 0, r["stderr"][-2000:]
    steps = r["steps"]
    assert len(steps) == 2
    for s in steps:
        assert s["refit_verified"] is True and _at_minimum(s)
        assert 0 < s["refit_bytes_same_device"] < s["refit_bytes_moved"]
        assert 1.0 <= s["token_mult_prob_error"] <= 1.001
    assert [s["refit_full_verified"] for s in steps] == [False, True]
    assert r["segments_after"] == r["segments_before"]


def _async_run(workdir: Path, *overrides: str) -> dict:
    """``mcore-reshard grpo`` on the async recipe for three steps, with completions long enough
    (240 tokens, 4 sequences at a time: the engine's 256-token context less the prompt) that the
    next step's requests are still decoding when a step's refit lands in flight (with 160, the
    training and refit of a step under a full test session's load outlasted them once in
    three sessions)."""
    logs = workdir / "logs"
    cmd = [sys.executable, "-m", "mcore_reshard.cli", "grpo", str(ASYNC_RECIPE), "grpo.max_num_steps=3",
           "grpo.verify_full_every_n_steps=3", "policy.generation.max_new_tokens=240", f"logger.log_dir={logs}",
           *overrides]
    return _cli(cmd, logs, 500)


def test_async_run_trains_on_samples_of_the_previous_version_each_token_checked_against_its_own(tmp_path):
    """Asynchronous GRPO (``recipes/grpo-tiny-moe-cpu-async.yaml``: AsyncLLM in an async Ray
    actor, in-flight overlapped refits, importance sampling):

    * step k trains on samples whose generation began at version k - 1 (they were generated
      while step k - 1 trained and refitted), never older than max_trajectory_age_steps = 1;
    * the refits land in flight: requests running across a swap carry tokens of two versions;
    * every token's ``token_mult_prob_error`` against the version that generated it (trainer
      snapshots) is at fp32's bound, while against the current policy it is far above it: the
      samples are off-policy, and the check still proves each refit served what the trainer held;
    * every refit verified at the minimum bytes, ``verify=full`` on the last.

    Whether a refit lands while the next step decodes is a race between that step's training
    and refit and the next step's decoding; the run starts in the background beside the rest of
    the suite, whose load can slow one side more than the other. A run in which no refit landed
    in flight is run once more, on its own, and everything is asserted on that run.
    """
    steps = _steps(BACKGROUND.result("grpo-async", _async_run), 3)
    if not _landed_in_flight(steps):
        steps = _steps(_async_run(tmp_path), 3)
    for s in steps:
        assert 1.0 <= s["token_mult_prob_error"] <= 1.001  # each token vs the version that made it
        assert s["policy_version"] == s["step"] and s["dropped_stale_samples"] == 0
        assert s["trajectory_age"] == s["policy_version"] - s["generation_versions"][0] <= 1
        assert s["snapshot_bytes"] > 0
    assert steps[0]["generation_versions"] == [0, 0] and steps[0]["trajectory_age"] == 0
    assert [s["generation_versions"][0] for s in steps[1:]] == [0, 1]  # started one version back
    assert all(s["trajectory_age"] == 1 for s in steps[1:])
    # in flight: a batch holds tokens of the version it began at and of the one after
    assert _landed_in_flight(steps), steps
    assert all(s["off_policy_token_mult_prob_error"] > 1.01 for s in steps[1:])  # stale vs the current policy
    assert [s["refit_full_verified"] for s in steps] == [False, False, True]


def _landed_in_flight(steps: list[dict]) -> bool:
    """Some step's batch holds tokens of the version it began at and of the one after."""
    return any(s["generation_versions"][1] == s["generation_versions"][0] + 1 for s in steps[1:])


def _drained_run(workdir: Path) -> dict:
    return _async_run(workdir, "grpo.async_grpo.max_trajectory_age_steps=2",
                      "grpo.async_grpo.in_flight_weight_updates=false", "policy.megatron_cfg.mcore_reshard.overlap=false",
                      "policy.generation.max_new_tokens=8")


def test_async_run_two_versions_ahead_with_drained_blocking_refits():
    """``max_trajectory_age_steps=2`` without in-flight updates, blocking refits: two steps'
    prompts generate ahead, each refit first waits until the requests running finish
    (``timing.drain``), so every batch's tokens come from the one version it began at and
    step 2 trains on the batch launched at step 0 (age 2, the most allowed)."""
    r = BACKGROUND.result("grpo-async-drained", _drained_run)
    assert r["returncode"] == 0, r["stderr"][-2000:]
    steps = r["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert [tuple(s["generation_versions"]) for s in steps] == [(0, 0), (0, 0), (0, 0)]
    assert [s["trajectory_age"] for s in steps] == [0, 1, 2]
    for s in steps:
        assert s["refit_verified"] is True and _at_minimum(s)
        assert 1.0 <= s["token_mult_prob_error"] <= 1.001 and "drain" in s["timing"]
    assert all(s["off_policy_token_mult_prob_error"] > 1.01 for s in steps[1:])  # stale vs the current policy
    assert steps[-1]["refit_full_verified"]


def _steps(r: dict, n: int) -> list[dict]:
    """The steps an ``n``-step run logged, once it ended cleanly with every refit verified at
    the minimum bytes."""
    assert r["returncode"] == 0, r["stderr"][-2000:]
    steps = r["steps"]
    assert [s["step"] for s in steps] == list(range(n))
    assert all(s["refit_verified"] is True and _at_minimum(s) for s in steps), steps
    return steps


def _two_steps(recipe: Path, *overrides: str) -> Callable[[Path], dict]:
    """A background job: ``mcore-reshard grpo recipe`` for two steps, ``verify=full`` on the last."""

    def run(workdir: Path) -> dict:
        logs = workdir / "logs"
        cmd = [sys.executable, "-m", "mcore_reshard.cli", "grpo", str(recipe), "grpo.max_num_steps=2",
               "grpo.verify_full_every_n_steps=2", f"logger.log_dir={logs}", *overrides]
        return _cli(cmd, logs, 400)

    return run


def _two_verified_steps(r: dict) -> list[dict]:
    """A two-step run's steps: every refit verified at the minimum, ``verify=full`` on the last,
    the rollouts' logprobs within fp32's bound of the policy's."""
    steps = _steps(r, 2)
    for s in steps:
        assert 1.0 <= s["token_mult_prob_error"] <= 1.001
    assert [s["refit_full_verified"] for s in steps] == [False, True]
    return steps


_lora_run = _two_steps(LORA_RECIPE)


def test_lora_run_refits_the_adapter_only_every_refit_verified():
    """A LoRA policy (``recipes/grpo-tiny-lora-cpu.yaml``: Megatron-Bridge's adapters on a TP2
    policy, one TP1 engine with LoRA slots): every step's rollouts name the engine's refit
    adapter and match the trainer's logprobs at fp32's bound, and every refit after the first
    (the base and the adapter, at start-up) moves the adapter only -- what the engine's slot
    holds of it, at the minimum -- verified, ``verify=full`` on the last."""
    from mcore_reshard.adapters.vllm.lora_rules import vllm_lora_layout
    from mcore_reshard.adapters.vllm.rules import VllmParallel
    from mcore_reshard.jobs.grpo.recipe import load_grpo_recipe

    recipe = load_grpo_recipe(LORA_RECIPE)
    slots = vllm_lora_layout(recipe.spec, VllmParallel(tp=1), recipe.peft)
    adapter_bytes = sum(p.numel - p.padding for p in slots.params) * 4  # fp32
    # the served adapter is the trained one: the rollouts' logprobs within fp32's bound
    for s in _two_verified_steps(BACKGROUND.result("grpo-lora", _lora_run)):
        assert s["refit_bytes_min"] == s["refit_bytes_full"] == adapter_bytes  # the adapter only


_fsdp_run = _two_steps(FSDP_RECIPE)


def test_megatron_fsdp_run_refits_every_step_verified():
    """A Megatron-FSDP policy (``recipes/grpo-tiny-fsdp-cpu.yaml``: ``use_custom_fsdp``, two
    ranks of data-parallel 2 x expert-parallel 2) on Ray: every step's refit moves the engine's
    minimum from the ranks' own rows, verified, ``verify=full`` on the last, and the rollouts'
    logprobs match Megatron-FSDP's forward at fp32's bound."""
    _two_verified_steps(BACKGROUND.result("grpo-fsdp", _fsdp_run))


_dtensor_run = _two_steps(DTENSOR_RECIPE, "policy.dtensor_cfg.mcore_reshard.canary=true")


def test_dtensor_run_refits_every_step_verified():
    """NeMo RL's DTensor policy (``recipes/grpo-tiny-dtensor-cpu.yaml``: ``policy.dtensor_cfg``,
    FSDP2 over two ranks) on Ray: every step's refit moves the engine's minimum from the ranks'
    own shards, verified, ``verify=full`` on the last, and the rollouts' logprobs match the
    policy's forward at fp32's bound. The canary is on (``mcore_reshard.canary``): every refit's
    engine checked its forward against the reference the DTensor ranks computed inside it."""
    steps = _two_verified_steps(BACKGROUND.result("grpo-dtensor", _dtensor_run))
    assert all(s["refit_canary_s"] > 0 for s in steps), steps


_llava_run = _two_steps(LLAVA_RECIPE)


def test_multimodal_run_with_a_frozen_tower_refits_every_step_verified():
    """GRPO with images (``recipes/grpo-tiny-llava-cpu.yaml``: megatron-core's LLaVA on two TP
    ranks, the tower frozen; ``env.colour_squares``: every prompt carries an image): the
    rollouts' logprobs -- image placeholders expanded, the images encoded by the engine's tower
    and the trainers' -- match at fp32's bound, and every step's refit moves the projector and
    the language model only (the tower went once, at start-up), verified, ``verify=full`` on
    the last."""
    from mcore_reshard.jobs.grpo.dry_run import dry_run
    from mcore_reshard.jobs.grpo.recipe import load_grpo_recipe

    report = dry_run(load_grpo_recipe(LLAVA_RECIPE))
    assert report.frozen_refit_bytes is not None and report.frozen_refit_bytes < report.plan.bytes_min
    for s in _two_verified_steps(BACKGROUND.result("grpo-llava", _llava_run)):
        assert s["refit_bytes_full"] == s["refit_bytes_min"] == report.frozen_refit_bytes  # no tower byte


#: Runs ``conftest.py`` starts when the session starts (one at a time, on a background thread)
#: for these tests: self-contained CLI runs, asserted on where the file order puts the tests.
BACKGROUND_JOBS = {
    "test_embedded_run_learns_every_refit_verified_and_ctrl_c_stops_it": ("grpo-embedded", _embedded_run),
    "test_colocated_run_keeps_same_device_bytes_off_the_group": ("grpo-colocated", _colocated_run),
    "test_async_run_trains_on_samples_of_the_previous_version_each_token_checked_against_its_own":
        ("grpo-async", _async_run),
    "test_async_run_two_versions_ahead_with_drained_blocking_refits": ("grpo-async-drained", _drained_run),
    "test_lora_run_refits_the_adapter_only_every_refit_verified": ("grpo-lora", _lora_run),
    "test_megatron_fsdp_run_refits_every_step_verified": ("grpo-fsdp", _fsdp_run),
    "test_dtensor_run_refits_every_step_verified": ("grpo-dtensor", _dtensor_run),
    "test_multimodal_run_with_a_frozen_tower_refits_every_step_verified": ("grpo-llava", _llava_run),
}


#: Jobs that start only when the suite's last live modules do (``conftest.LATE_FROM``): they
#: then run beside tests that leave a core idle (these two-node tests among them: the tests
#: that wait for a job run after them), not beside the live modules that keep both busy.
LATE_JOBS = {"grpo-dtensor", "grpo-llava"}


@pytest.fixture(scope="module")
def two_nodes():
    """Head (no CPUs: runs no actor), node A with 2 CPUs, node B with 1: the trainers' PACK
    group (2 bundles) fits only on A, the engine's then only on B."""
    from mcore_reshard.jobs.grpo.ray_cluster import _prepare_env

    home_token = Path.home() / ".ray" / "auth_token"
    had_token = home_token.exists()
    _prepare_env(embedded=True)
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="mr_rc_", dir="/tmp")  # Ray's session files, removed below
    old_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        a = cluster.add_node(num_cpus=2)
        b = cluster.add_node(num_cpus=1)
        yield cluster, a, b
    finally:
        import ray

        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        if old_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old_tmpdir
        assert had_token or not home_token.exists(), "the run wrote ~/.ray/auth_token"


def _recipe(tmp_path: Path, *overrides: str):
    from mcore_reshard.jobs.grpo.recipe import load_grpo_recipe

    return load_grpo_recipe(RECIPE, [f"logger.log_dir={tmp_path / 'logs'}", *overrides])


def test_two_nodes_placement_and_a_dead_trainer_actor_stops_the_run(two_nodes, tmp_path):
    """Trainers on node A, the engine on node B, the refit master on A; then a trainer actor
    killed mid-run stops the run with an error naming it, and no process of the run survives."""
    from mcore_reshard.errors import RefitError, TrainerError
    from mcore_reshard.jobs.grpo.loop import GrpoRun

    _, node_a, node_b = two_nodes
    before = set(_run_processes())
    # With a KL penalty: the trainers also compute the frozen reference's logprobs each step.
    recipe = _recipe(tmp_path, "grpo.max_num_steps=3", "grpo.verify_full_every_n_steps=0",
                     "loss_fn.reference_policy_kl_penalty=0.01")
    run = GrpoRun(recipe)
    with run:
        place = run.placement()
        assert set(place["trainers"]) == {node_a.node_id} and place["engines"] == [node_b.node_id]
        assert place["master"] == node_a.node_ip_address
        m = run.step(0)
        assert m.refit_verified and _at_minimum(asdict(m))
        assert "reference_logprob_inference" in m.timing
        assert run.initial_refit.verified
        assert len(_marked("RAY_AUTH_TOKEN", os.environ["RAY_AUTH_TOKEN"])) >= 4
        # the session's fast start reaches the engine actor: its engine core comes from the
        # actor's own fork server, not spawned by the actor
        assert _engine_starts("RAY_AUTH_TOKEN", os.environ["RAY_AUTH_TOKEN"]) == {"fork server"}
        victim = run.trainers.actors[1]
        run.trainers.kill(1)
        t0 = time.monotonic()
        with pytest.raises((TrainerError, RefitError)) as err:
            run.step(1)
        waited = time.monotonic() - t0
    msg = str(err.value)
    assert "training rank 1" in msg and "died" in msg and victim._actor_id.hex()[:12] in msg, msg
    assert "\n" not in msg
    assert waited < recipe.refit.timeout_s  # named by Ray's death notice, not found by a timeout

    # Every process the run started is gone: actors, vLLM's engine core, megatron ranks (only
    # the cluster's own daemons and the idle workers Ray keeps in its pool remain).
    assert not _survivors(before, "RAY_AUTH_TOKEN", os.environ["RAY_AUTH_TOKEN"]), "processes survived the run"


def test_a_crashed_trainer_actor_is_named_with_its_last_words(two_nodes):
    """A training actor that dies of a fatal signal is named at once, with the end of its
    stderr: the Python stack ``faulthandler`` printed (Ray removes an embedded cluster's logs
    at shutdown, and reports the death itself only as a lost connection)."""
    import ray

    from mcore_reshard.errors import TrainerError
    from mcore_reshard.jobs.grpo.ray_cluster import RayTrainerGroup
    from mcore_reshard.wire.protocol import first_error_line

    class CrashingRank:  # a framework's training actor (defined here: Ray ships it by value)
        def run(self, call):
            import faulthandler

            faulthandler._sigsegv()  # a fatal SIGSEGV, as a native library's bug would raise

    group = RayTrainerGroup([ray.remote(num_cpus=0, max_restarts=0)(CrashingRank).remote()], timeout_s=60)
    with pytest.raises(TrainerError) as err:
        group.describe().wait()
    msg = str(err.value)
    first, _, words = msg.partition("\n")
    assert "training rank 0" in first and "died during 'describe'" in first, msg
    assert "stderr ended with:" in words and "Fatal Python error: Segmentation fault" in words, msg
    assert "test_grpo_ray.py\", line" in words and " in run" in words, msg  # the crashing frame
    assert first_error_line(err.value) == first  # where one line is shown: the death, not a frame


def test_async_run_recovers_from_a_refit_that_fails_in_the_background(two_nodes, tmp_path):
    """Async GRPO (overlapped, in-flight refits) on the two-node cluster: the refit of step 1
    fails in the background, step 2's prompts launched before it (a trainer flips a bit on the
    wire, after its checksum); the engine keeps its old weights, the run retries the refit once
    in a new group, and step 2 trains on samples whose every token matches the version that
    generated it."""
    from mcore_reshard.wire.faults import Faults, TrainerFault
    from mcore_reshard.jobs.grpo.loop import GrpoRun
    from mcore_reshard.jobs.grpo.recipe import load_grpo_recipe
    from mcore_reshard.wire.faults import Fault

    recipe = load_grpo_recipe(ASYNC_RECIPE, [f"logger.log_dir={tmp_path / 'logs'}", "grpo.max_num_steps=3",
                                             "grpo.verify_full_every_n_steps=0", "policy.generation.max_new_tokens=32"])
    with GrpoRun(recipe) as run:
        assert run.placement()["engines"] == [two_nodes[2].node_id]
        steps = [run.step(0)]
        refit = run.driver.refit
        failed: list = []

        def flip_once(request=None, **kw):
            if failed:
                return refit(request=request, **kw)
            try:
                return refit(request=request, faults=Faults(TrainerFault(0, Fault("bitflip", bucket=0))))
            except Exception as exc:
                failed.append(str(exc))
                raise

        run.driver.refit = flip_once
        steps += [run.step(1), run.step(2)]
        served = run.engines[0].get_weight_version()
    assert len(failed) == 1 and "checksum mismatch" in failed[0], failed
    assert run.refit_retries == 1
    assert served == "3" and [s.policy_version for s in steps] == [0, 1, 2]
    for s in steps:
        assert s.refit_verified and _at_minimum(asdict(s))
        assert 1.0 <= s.token_mult_prob_error <= 1.001  # each token vs the version that generated it
    assert steps[2].trajectory_age == 1 and steps[2].generation_versions[0] == 1
