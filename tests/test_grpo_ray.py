"""GRPO on Ray, for real: megatron-core trainer actors and a vLLM engine actor on a simulated
two-node Ray cluster (``ray.cluster_utils.Cluster``), a refit after every step.

* the tiny recipe learns its task (reward rises far above a random policy's), every refit is
  verified (checksums every step, ``verify=full`` every 4th), ``token_mult_prob_error`` stays at
  fp32's bound, bytes moved equal the minimum, and trainers and engine sit on different nodes;
* a trainer actor killed mid-run stops the run with an error naming it, and no process of the
  run survives;
* nothing is left in the home directory (Ray's token auth runs on a per-job token in the env).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo-tiny-moe-cpu.yaml"


@pytest.fixture(scope="module")
def two_nodes():
    """Head (no CPUs: runs no actor), node A with 2 CPUs, node B with 1: the trainers' PACK
    group (2 bundles) fits only on A, the engine's then only on B."""
    from mcore_reshard.grpo.ray_cluster import _prepare_env

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
    from mcore_reshard.grpo.recipe import load_grpo_recipe

    return load_grpo_recipe(RECIPE, [f"logger.log_dir={tmp_path / 'logs'}", *overrides])


def test_grpo_learns_on_two_nodes_every_refit_verified(two_nodes, tmp_path, capsys):
    from mcore_reshard.grpo.loop import run_grpo

    _, node_a, node_b = two_nodes
    recipe = _recipe(tmp_path, "grpo.max_num_steps=8")
    assert run_grpo(recipe, as_json=True) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    steps = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(8)) and steps == out["steps"]
    assert (tmp_path / "logs" / "grpo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Placement: the trainers share node A, the engine is on node B, the refit master is A's.
    place = out["placement"]
    assert set(place["trainers"]) == {node_a.node_id}
    assert place["engines"] == [node_b.node_id]

    for s in steps:
        assert s["refit_verified"] is True
        assert s["refit_bytes_moved"] == s["refit_bytes_min"] > 0
        assert 1.0 <= s["token_mult_prob_error"] <= 1.001  # fp32 on both sides
        assert set(s["timing"]) >= {"generation", "logprob_inference", "policy_training", "refit", "total"}
    assert [s["refit_full_verified"] for s in steps] == [(i + 1) % 4 == 0 for i in range(8)]

    # Learning: a random policy scores target_ids / vocab = 0.125 per token. The mean of a
    # step's 128 sampled tokens has a std of about sqrt(0.125 * 0.875 / 128) = 0.03 under it,
    # so +0.2 is over six standard deviations: the rise is the policy's, not sampling noise.
    rewards = [s["reward"] for s in steps]
    random_reward = out["random_policy_reward"]
    assert random_reward == pytest.approx(0.125)
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2
    assert sum(rewards[-2:]) / 2 > random_reward + 0.2


def _run_processes() -> dict[int, str]:
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            out[p.pid] = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            pass
    return out


def test_trainer_actor_death_stops_the_run_and_leaves_no_process(two_nodes, tmp_path):
    from mcore_reshard.errors import RefitError, TrainerError
    from mcore_reshard.grpo.loop import GrpoRun

    before = set(_run_processes())
    recipe = _recipe(tmp_path, "grpo.max_num_steps=3", "grpo.verify_full_every_n_steps=0")
    run = GrpoRun(recipe)
    with run:
        assert run.step(0).refit_verified
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
    deadline = time.monotonic() + 30
    while True:
        left = {pid: cmd for pid, cmd in _run_processes().items()
                if pid not in before and not any(k in cmd for k in ("ray::IDLE", "raylet", "gcs_server"))}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"processes survived the run: {left}"
