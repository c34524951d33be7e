"""GRPO recipes and ``mcore-reshard grpo --dry-run``: the numbers agree with the plan, every
bad setting is one ``error:`` line naming the key (exit 2), overrides apply. No process starts:
the loop is replaced by a stub wherever the CLI would reach it."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from mcore_reshard.cli import main
from mcore_reshard.errors import ConfigError
from mcore_reshard.jobs.grpo.dry_run import dry_run, modelled_refit_seconds, placement
from mcore_reshard.jobs.grpo.recipe import ClusterSettings, GrpoRecipe, load_grpo_recipe
from mcore_reshard.plan.report import format_bytes
from mcore_reshard.wire.protocol import VerifyMode
from mcore_reshard.settings import load_recipe
from mcore_reshard.settings.policy import from_policy_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "grpo-tiny-moe-cpu.yaml"
ASYNC = REPO / "recipes" / "grpo-tiny-moe-cpu-async.yaml"
QWEN_4N = REPO / "recipes" / "grpo-qwen3-30b-a3b-megatron-reshard.yaml"
QWEN_8N = REPO / "recipes" / "grpo-qwen3-30b-a3b-8n8g-megatron-reshard.yaml"
QWEN_ASYNC = REPO / "recipes" / "grpo-qwen3-30b-a3b-megatron-reshard-async.yaml"
QWEN_FP8 = REPO / "recipes" / "grpo-qwen3-30b-a3b-megatron-reshard-fp8.yaml"
QWEN_FSDP = REPO / "recipes" / "grpo-qwen3-30b-a3b-megatron-fsdp.yaml"
TINY_FSDP = REPO / "recipes" / "grpo-tiny-fsdp-cpu.yaml"
TINY_DTENSOR = REPO / "recipes" / "grpo-tiny-dtensor-cpu.yaml"
# (recipe, training ranks, generation ranks, engines, training nodes, generation nodes)
QWEN = [(QWEN_4N, 16, 16, 8, 2, 2), (QWEN_8N, 32, 32, 8, 4, 4)]


def _json(capsys, argv) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _one_line_error(capsys, argv, key: str) -> str:
    assert main([str(a) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert key in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def loop_stub(monkeypatch):
    """The CLI's GRPO loop (``mcore_reshard.jobs.grpo.loop.run_grpo``) as a stub that records
    its calls: these tests check what happens before the loop, so nothing starts (the CLI
    imports it from there when a run starts)."""
    import mcore_reshard.jobs.grpo.loop as cli

    calls = []

    def run_grpo(recipe, *, address=None, as_json=False):
        calls.append((recipe, address, as_json))
        return 0

    monkeypatch.setattr(cli, "run_grpo", run_grpo)
    return calls


# --------------------------------------------------------------------------- dry runs


# 4n8g only: the 8n8g recipe's dry run is checked by its table test (each costs a full-size plan).
@pytest.mark.heavy  # full-size plans
@pytest.mark.plans("qwen3-30b-a3b")  # the 4n8g recipe's layouts and placement are the default's
@pytest.mark.parametrize("path, train, gen, engines, train_nodes, gen_nodes", QWEN[:1], ids=["4n8g"])
def test_qwen_dry_run_json_agrees_with_the_plan(path, train, gen, engines, train_nodes, gen_nodes, capsys):
    plan = _json(capsys, ["plan", "--json", "--recipe", str(path)])
    rep = _json(capsys, ["grpo", str(path), "--dry-run", "--json"])
    assert rep["bytes_min"] == rep["bytes_planned"] == plan["bytes_min"] == plan["bytes_planned"]
    assert rep["bytes_hf_broadcast"] == plan["bytes_hf_broadcast"]
    assert rep["plan"]["digest"] == plan["digest"]
    assert rep["busiest_dst_bytes"] == plan["max_recv_bytes"]
    assert rep["busiest_rank_bytes"] == max(plan["max_send_bytes"], plan["max_recv_bytes"])
    assert (rep["training_ranks"], rep["generation_ranks"], rep["engines"]) == (train, gen, engines)
    assert (rep["training_nodes"], rep["generation_nodes"]) == (train_nodes, gen_nodes)
    assert rep["nodes_used"] == rep["num_nodes"] == train_nodes + gen_nodes and not rep["shared_node"]
    assert rep["slots"] == train + gen
    # trainers and engines on separate nodes: the inter-node link, GB/s = 1e9 bytes/s
    assert rep["link"] == "inter-node" and rep["link_gbps"] == rep["inter_node_gbps"] == 50.0
    # the plan the job runs on this placement (fan-out relays), modelled over both link classes
    assert rep["modelled_refit_seconds"] == pytest.approx(plan["modelled_seconds"])
    # (above the floor only by what one engine replicates over its TP ranks: norms, the router)
    assert plan["bytes_inter_node_min"] <= rep["bytes_inter_node"] == plan["bytes_inter_node"] <= 1.01 * plan["bytes_inter_node_min"]
    assert rep["modelled_hf_broadcast_seconds"] == pytest.approx(rep["bytes_hf_broadcast"] / 50e9)
    assert rep["buffer_bytes_per_rank"] == 1 << 30
    assert rep["buffer_bytes_training"] == train << 30 and rep["buffer_bytes_generation"] == gen << 30
    assert rep["local_problem"] and "transformer_impl" in rep["local_problem"]


@pytest.mark.heavy  # a full-size plan
@pytest.mark.plans("qwen3-30b-a3b")
def test_qwen_4n8g_dry_run_table(capsys):
    assert main(["grpo", str(QWEN_4N), "--dry-run"]) == 0
    text = capsys.readouterr().out
    # the link floor of shared/reference/peers-and-numbers.md: 30.54 GB over 50 GB/s
    # one copy per inference node over the fabric, spread over its 8 NICs: 61 GB / 8 at 50 GB/s
    assert "modelled refit time          0.157 s  (slowest rank's links: 450 GB/s intra-node, 50 GB/s inter-node)" \
        in text
    assert "16 training + 16 generation ranks (8 engine(s)) on 2 + 2 of 4 nodes" in text
    assert "no published figure" in text
    assert "(= minimum)" in text


@pytest.mark.heavy  # a full-size plan
def test_qwen_8n8g_dry_run_table_names_the_published_figure(capsys):
    assert main(["grpo", str(QWEN_8N), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "32 training + 32 generation ranks (8 engine(s)) on 4 + 4 of 8 nodes" in text
    assert "megatron(tp=4,pp=4,vpp=1,ep=4,etp=1,cp=1,dp=2) -> vllm(tp=4,pp=1,dp=1,replicas=8)" in text
    assert "refit 12 s of a 167 s step" in text


@pytest.mark.heavy  # a full-size plan
def test_nccl_reshard_layout_shows_nemo_rl_figure(capsys):
    """EP8xPP2 -> two engines of TP8: NeMo RL's nccl_reshard measurement sits beside our model."""
    rep = _json(capsys, ["grpo", str(QWEN_4N), "policy.generation.vllm_cfg.tensor_parallel_size=8", "--dry-run",
                         "--json"])
    assert rep["engines"] == 2 and rep["published"]["seconds"] == "0.74-1.00 s"
    assert 0.15 < rep["modelled_refit_seconds"] < 0.16  # 7.68 GB per receiver at 50 GB/s


def test_tiny_recipe_loads_and_runs_here(capsys):
    r = load_grpo_recipe(TINY)
    assert isinstance(r, GrpoRecipe) and r.local_problem is None
    assert r.model == "tiny-moe" and r.checkpoint_family == "qwen3_moe"
    assert r.dtype == r.spec.dtype == "float32" and r.spec.num_experts == 8 and r.spec.vocab == 1000
    assert (r.training.tp, r.training.ep, r.training.dp, r.training.world_size) == (1, 2, 2, 2)
    assert r.training.layer_spec == "local" and r.training.experts == "sequential"
    assert (r.vllm.tp, r.vllm.replicas, r.vllm.world_size) == (1, 1, 1)
    assert r.refit.verify is VerifyMode.CHECKSUM and r.refit.buffer_bytes == 262144 and r.refit.timeout_s == 120
    assert (r.grpo.num_prompts_per_step, r.grpo.num_generations_per_prompt, r.grpo.max_num_steps) == (4, 4, 12)
    assert r.grpo.verify_full_every_n_steps == 4
    assert r.generation.max_new_tokens == 8 and r.generation.temperature == 1.0
    assert r.task.prompt_length == 8 and r.task.target_ids(r.spec.vocab) == 125
    assert r.cluster == ClusterSettings(1, 3) and r.ray.address is None and r.ray.num_cpus is None
    assert r.lr == 0.05 and r.log_dir == "results/grpo-tiny-moe-cpu" and r.colocated is False
    rep = _json(capsys, ["grpo", str(TINY), "--dry-run", "--json"])
    assert rep["shared_node"] and rep["link"] == "intra-node" and rep["nodes_used"] == 1
    assert (rep["training_ranks"], rep["generation_ranks"], rep["slots"]) == (2, 1, 3)
    assert rep["modelled_refit_seconds"] == pytest.approx(rep["busiest_rank_bytes"] / 450e9)
    assert rep["published"] is None and rep["local_problem"] is None


def test_megatron_fsdp_recipes(capsys):
    """``policy.megatron_cfg.use_custom_fsdp``: the tiny recipe runs here (two Megatron-FSDP ranks,
    data-parallel 2 x expert-parallel 2); the 30B one plans at the minimum bytes, the busiest
    training rank sending no more than any other (each rank holds its own rows: the planner
    has no replica to balance, Megatron-FSDP's even buckets do it). A LoRA policy is refused."""
    tiny = load_grpo_recipe(TINY_FSDP)
    assert tiny.training.fsdp and (tiny.training.dp, tiny.training.ep) == (2, 2) and tiny.local_problem is None
    rep = _json(capsys, ["grpo", str(TINY_FSDP), "--dry-run", "--json"])
    assert rep["bytes_planned"] == rep["bytes_min"] and rep["training_layout"].endswith(",fsdp)")
    big = load_grpo_recipe(QWEN_FSDP)
    assert big.training.fsdp and (big.training.pp, big.training.dp, big.training.ep) == (1, 16, 8)
    with pytest.raises(ConfigError, match=r"use_custom_fsdp=true with peft.enabled=true"):
        load_grpo_recipe(TINY_FSDP, overrides=["policy.megatron_cfg.peft.enabled=true"])


def test_the_dtensor_recipe_selects_nemo_rls_dtensor_backend(capsys):
    """``policy.dtensor_cfg.enabled`` (``megatron_cfg`` off): a DTensor policy (FSDP2 over the
    training world, TP by ``tensor_parallel_size``) whose refit is ``dtensor_cfg.mcore_reshard``
    and whose learning rate is NeMo RL's ``policy.optimizer.kwargs.lr``; it plans at the
    minimum with each rank sending its own half, and runs here. What the DTensor policy here
    does not build is one line (``BAD_DTENSOR``)."""
    from mcore_reshard.adapters.dtensor import DTensorParallel

    r = load_grpo_recipe(TINY_DTENSOR)
    assert r.training == DTensorParallel(dp=2, tp=1) and r.lr == 0.05 and r.local_problem is None
    assert r.refit.buffer_bytes == 262144 and r.spec.num_experts == 0
    rep = _json(capsys, ["grpo", str(TINY_DTENSOR), "--dry-run", "--json"])
    assert rep["training_layout"] == "dtensor(dp=2,tp=1)" and rep["bytes_planned"] == rep["bytes_min"]
    assert rep["busiest_src_bytes"] <= 1.01 * rep["mean_src_bytes"]


@pytest.mark.heavy  # a full-size plan
@pytest.mark.plans("qwen3-30b-a3b-megatron-fsdp")
def test_the_30b_megatron_fsdp_dry_run_reports_bytes_and_the_busiest_training_rank(capsys):
    rep = _json(capsys, ["grpo", str(QWEN_FSDP), "--dry-run", "--json"])
    assert rep["training_layout"] == "megatron(tp=1,pp=1,vpp=1,ep=8,etp=1,cp=1,dp=16,fsdp)"
    # the engines' minimum, as without FSDP (the 4n8g recipe: the same engines, trainers PP2 x EP8)
    assert rep["bytes_planned"] == rep["bytes_min"] == _json(capsys, ["grpo", str(QWEN_4N), "--dry-run", "--json"])["bytes_min"]
    assert rep["busiest_src_bytes"] <= 1.01 * rep["mean_src_bytes"]  # 16 ranks, each its own rows
    text = (main(["grpo", str(QWEN_FSDP), "--dry-run"]), capsys.readouterr().out)[1]
    assert "busiest training rank        rank " in text and "(= minimum)" in text


def test_async_recipe_loads_with_nemo_rl_keys_and_runs_here(capsys):
    """The async recipe is the synchronous one plus NeMo RL's async keys (and an overlapped
    refit); the KV policy of async_grpo reaches the refit."""
    sync, r = load_grpo_recipe(TINY), load_grpo_recipe(ASYNC)
    assert sync.async_grpo.enabled is False and sync.async_engine is False
    assert r.local_problem is None and r.async_engine is True and r.loss.use_importance_sampling_correction
    a = r.async_grpo
    assert (a.enabled, a.max_trajectory_age_steps, a.in_flight_weight_updates,
            a.recompute_kv_cache_after_weight_updates) == (True, 1, True, True)
    assert r.refit.overlap and r.refit.recompute_kv_cache_after_weight_updates
    assert replace(r.refit, overlap=False, recompute_kv_cache_after_weight_updates=False) == sync.refit
    off = load_grpo_recipe(ASYNC, ["grpo.async_grpo.recompute_kv_cache_after_weight_updates=false"])
    assert off.refit.recompute_kv_cache_after_weight_updates is False
    rep = _json(capsys, ["grpo", str(ASYNC), "--dry-run", "--json"])
    assert rep["async_grpo"] == {"enabled": True, "max_trajectory_age_steps": 1, "in_flight_weight_updates": True,
                                 "recompute_kv_cache_after_weight_updates": True}


@pytest.mark.heavy  # a full-size plan
@pytest.mark.plans("qwen3-30b-a3b")
def test_qwen_async_variant_dry_runs_with_the_same_plan():
    """The async variant of the 4n8g recipe: NeMo RL's async keys and an overlapped refit on
    the same layouts and buckets as the 4n8g recipe (the plan is a pure function of them, so
    the same plan: ``test_qwen_dry_run_json_agrees_with_the_plan`` checks that one); its dry
    run says how the steps overlap and how much shadow memory a vLLM rank holds."""
    sync, r = load_grpo_recipe(QWEN_4N), load_grpo_recipe(QWEN_ASYNC)
    assert r.async_grpo.enabled and r.async_engine and r.refit.overlap and r.loss.use_importance_sampling_correction
    assert (r.training, r.vllm, r.spec, r.refit.bucket_bytes, r.refit.allow_cast) == \
        (sync.training, sync.vllm, sync.spec, sync.refit.bucket_bytes, sync.refit.allow_cast)
    rep = dry_run(r)
    assert ("asynchronous: max trajectory age 1 step(s), in-flight overlapped refits, KV kept across a swap; "
            f"shadow weights up to {format_bytes(rep.busiest_dst_bytes)} per vLLM rank") in rep.table()
    j = rep.to_json()
    assert j["bytes_planned"] == j["bytes_min"] and j["overlap"] and j["async_grpo"]["enabled"]
    assert j["async_grpo"]["recompute_kv_cache_after_weight_updates"] is False


@pytest.mark.heavy  # a full-size plan
@pytest.mark.plans("qwen3-30b-a3b-fp8")
def test_qwen_fp8_variant_dry_runs_with_fp8_bytes():
    """The FP8 variant of the 4n8g recipe: the same layouts into block-FP8 engines; every
    attention and expert weight moves as codes + scales (half its bf16 bytes), the router,
    norms, embeddings and LM head in bf16 (``test_fp8.py`` checks on small plans that nothing
    else changes)."""
    sync, r = load_grpo_recipe(QWEN_4N), load_grpo_recipe(QWEN_FP8)
    assert r.vllm.quantization == "fp8_per_block" and sync.vllm.quantization is None
    assert (r.training, r.spec, r.refit.bucket_bytes) == (sync.training, sync.spec, sync.refit.bucket_bytes)
    fp8 = dry_run(r)
    j = fp8.to_json()
    assert j["bytes_planned"] == j["bytes_min"]
    plan = j["plan"]
    assert plan["quantized_bytes"] <= 0.52 * plan["quantized_bytes_unquantized"]
    assert len(plan["quantized"]) == 48 * (4 + 3 * 128)  # q/k/v/o and every expert's three, per layer
    assert not any(q["tensor"].endswith(("mlp.gate.weight", "embed_tokens.weight")) for q in plan["quantized"])
    assert j["vllm_layout"].endswith(",fp8_per_block)")
    assert "FP8 rollout                  quantized at the sender (block FP8 128x128): 18624 tensors" in fp8.table()


def test_qwen_recipes_are_plan_only():
    for path in (QWEN_4N, QWEN_8N, QWEN_ASYNC, QWEN_FP8):
        r = load_grpo_recipe(path)
        assert r.model == "Qwen/Qwen3-30B-A3B" and r.checkpoint_family is None
        assert r.generation.max_new_tokens == 4096  # ${policy.max_total_sequence_length}
        assert "transformer_impl='transformer_engine'" in r.local_problem
    no_te = load_grpo_recipe(QWEN_4N, ["policy.megatron_cfg.transformer_impl=local",
                                       "policy.megatron_cfg.moe_grouped_gemm=false"])
    assert "policy.model_name='Qwen/Qwen3-30B-A3B'" in no_te.local_problem  # a hub name


def test_cost_model_and_placement_are_pure():
    assert modelled_refit_seconds(50 * 10**9, 50.0) == 1.0
    assert modelled_refit_seconds(0, 400.0) == 0.0
    with pytest.raises(ConfigError, match="bandwidth"):
        modelled_refit_seconds(1, 0.0)
    r = load_grpo_recipe(TINY)
    with pytest.raises(ConfigError, match="do not fit"):
        placement(replace(r, cluster=ClusterSettings(1, 2)))
    with pytest.raises(ConfigError, match="bandwidth"):
        dry_run(r, inter_node_gbps=-1.0)


# --------------------------------------------------------------------------- the run path


def test_run_path_calls_the_loop(loop_stub, capsys):
    assert main(["grpo", str(TINY), "grpo.max_num_steps=3", "--json", "--address", "auto"]) == 0
    (recipe, address, as_json), = loop_stub
    assert recipe.grpo.max_num_steps == 3 and address == "auto" and as_json is True


def test_colocated_recipe_plans_same_device_and_runs(tmp_path, capsys, loop_stub):
    """policy.generation.colocated.enabled: both sides on every slot (training rank i and vLLM
    worker i on device i): the dry run plans it (same-device bytes, nothing over the fabric)
    and the run path hands it to the loop (tests/test_grpo_ray.py runs it live)."""
    d = yaml.safe_load(TINY.read_text())
    _edit(d, "policy.generation.colocated.enabled", True)
    _edit(d, "cluster.gpus_per_node", 4)
    f = tmp_path / "colocated.yaml"
    f.write_text(yaml.safe_dump(d))
    r = load_grpo_recipe(f)
    assert r.colocated and r.training.world_size == r.vllm.world_size == 4 and r.vllm.replicas == 4
    rep = _json(capsys, ["grpo", str(f), "--dry-run", "--json"])
    assert rep["colocated"] and rep["nodes_used"] == 1
    assert rep["bytes_inter_node"] == rep["bytes_inter_node_min"] == 0 and rep["bytes_same_device"] > 0
    assert rep["bytes_hf_ipc"] == rep["bytes_hf_broadcast"]  # NeMo RL: every worker gets the full model
    assert main(["grpo", str(f)]) == 0
    (recipe, _, _), = loop_stub
    assert recipe.colocated


def test_colocated_unset_reads_the_same_everywhere(tmp_path):
    """A recipe without ``policy.generation.colocated.enabled`` takes NeMo RL's default
    (colocated) in the layout reader and in the GRPO recipe reader alike (one field, one
    default), so the placement planned is the one the job runs."""
    d = yaml.safe_load(TINY.read_text())
    del d["policy"]["generation"]["colocated"]["enabled"]
    _edit(d, "cluster.gpus_per_node", 4)
    f = tmp_path / "unset.yaml"
    f.write_text(yaml.safe_dump(d))
    r = load_grpo_recipe(f)
    layout = from_policy_config(load_recipe(f))
    assert r.colocated is True and layout.topology.placement == "colocated"


def test_run_path_refuses_what_this_machine_cannot_run(loop_stub, capsys):
    _one_line_error(capsys, ["grpo", QWEN_4N], "policy.megatron_cfg.transformer_impl='transformer_engine'")
    assert loop_stub == []


def test_the_tiny_recipe_with_fp8_generation_plans_but_its_run_is_refused_in_one_line(tmp_path, capsys, loop_stub):
    """``policy.generation.vllm_cfg.precision: fp8`` on the tiny recipe (a block-shaped model):
    the dry run plans the FP8 refit; the local run says in one line that it starts no FP8
    engine yet, on every CPU -- never a bf16 engine in its place."""
    d = yaml.safe_load(TINY.read_text())
    _edit(d, "policy.generation.vllm_cfg.precision", "fp8")
    _edit(d, "policy.model_name", "tiny-moe-128")
    f = tmp_path / "fp8.yaml"
    f.write_text(yaml.safe_dump(d))
    r = load_grpo_recipe(f)
    assert r.vllm.quantization == "fp8_per_block" and dry_run(r).to_json()["vllm_layout"].endswith(",fp8_per_block)")
    _one_line_error(capsys, ["grpo", f], "policy.generation.vllm_cfg.precision=fp8: the local GRPO run does not start")
    assert loop_stub == []


# --------------------------------------------------------------------------- bad input


def _edit(d: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    node = d
    for p in parents:
        node = node.setdefault(p, {})
    if value is _DROP:
        del node[leaf]
    else:
        node[leaf] = value


_DROP = object()
_ASYNC = {"grpo.async_grpo.enabled": True, "policy.generation.vllm_cfg.async_engine": True,
          "loss_fn.use_importance_sampling_correction": True}
BAD = [
    ("missing-steps", {"grpo.max_num_steps": _DROP}, "grpo.max_num_steps is missing"),
    ("missing-grpo", {"grpo": _DROP}, "grpo is missing"),
    ("missing-max-new-tokens", {"policy.generation.max_new_tokens": _DROP}, "policy.generation.max_new_tokens"),
    ("missing-lr", {"policy.megatron_cfg.optimizer.lr": _DROP}, "policy.megatron_cfg.optimizer.lr is missing"),
    ("prompts-string", {"grpo.num_prompts_per_step": "four"}, "grpo.num_prompts_per_step='four'"),
    ("normalize-string", {"grpo.normalize_rewards": "yes"}, "grpo.normalize_rewards"),
    ("one-generation", {"grpo.num_generations_per_prompt": 1}, "grpo.num_generations_per_prompt=1"),
    ("zero-steps", {"grpo.max_num_steps": 0}, "grpo.max_num_steps=0"),
    ("negative-verify-every", {"grpo.verify_full_every_n_steps": -1}, "grpo.verify_full_every_n_steps=-1"),
    ("unknown-grpo-key", {"grpo.max_num_epochs": 1}, "grpo.max_num_epochs"),
    ("unknown-loss-key", {"loss_fn.ratio_clip_c": 3.0}, "loss_fn.ratio_clip_c"),
    ("unknown-env", {"env.math": {"num_workers": 8}}, "env.math"),
    ("unknown-task-key", {"env.target_tokens.vocab": 5}, "env.target_tokens.vocab"),
    ("unknown-ray-key", {"ray.port": 1}, "ray.port"),
    ("negative-kl", {"loss_fn.reference_policy_kl_penalty": -0.1}, "loss_fn.reference_policy_kl_penalty"),
    ("zero-temperature", {"policy.generation.temperature": 0}, "policy.generation.temperature=0"),
    ("lr-zero", {"policy.megatron_cfg.optimizer.lr": 0.0}, "policy.megatron_cfg.optimizer.lr=0.0"),
    ("lr-string", {"policy.megatron_cfg.optimizer.lr": "fast"}, "policy.megatron_cfg.optimizer.lr='fast'"),
    ("fraction-one", {"env.target_tokens.target_fraction": 1.0}, "env.target_tokens.target_fraction=1.0"),
    ("fraction-tiny", {"env.target_tokens.target_fraction": 0.0001}, "env.target_tokens.target_fraction"),
    ("too-long", {"policy.generation.max_new_tokens": 600}, "max_position_embeddings=512"),
    ("cluster-too-small", {"cluster.gpus_per_node": 2}, "cluster.num_nodes*cluster.gpus_per_node=2"),
    ("cluster-no-training", {"cluster.gpus_per_node": 1}, "cluster.num_nodes*cluster.gpus_per_node=1"),
    ("two-nodes-split", {"cluster.num_nodes": 2}, "policy.generation.colocated.resources.gpus_per_node=1"),
    ("one-node-two-gen-nodes", {"policy.generation.colocated.resources.num_nodes": 2},
     "policy.generation.colocated.resources"),
    ("num-cpus-with-address", {"ray.address": "auto", "ray.num_cpus": 4}, "ray.num_cpus=4"),
    ("uneven-batch", {"grpo.num_prompts_per_step": 3, "grpo.num_generations_per_prompt": 3},
     "grpo.num_prompts_per_step*num_generations_per_prompt=9"),
    ("not-a-model", {"policy.model_name": "no-such-model"}, "policy.model_name='no-such-model'"),
    ("grpo-list", {"grpo": [1, 2]}, "grpo is a list"),
    ("tiny-with-model-config", {"policy.model_config": "qwen3-30b-a3b"}, "policy.model_config='qwen3-30b-a3b'"),
    # asynchronous GRPO: NeMo RL's combinations
    ("async-sync-engine", {"grpo.async_grpo.enabled": True, "loss_fn.use_importance_sampling_correction": True},
     "grpo.async_grpo.enabled=true needs policy.generation.vllm_cfg.async_engine=true"),
    ("async-colocated", {**_ASYNC, "policy.generation.colocated.enabled": True},
     "grpo.async_grpo.enabled=true with policy.generation.colocated.enabled=true"),
    ("async-no-importance-sampling", {**_ASYNC, "loss_fn.use_importance_sampling_correction": False},
     "loss_fn.use_importance_sampling_correction=true"),
    ("async-age-zero", {**_ASYNC, "grpo.async_grpo.max_trajectory_age_steps": 0},
     "grpo.async_grpo.max_trajectory_age_steps=0"),
    ("in-flight-sync-engine", {"grpo.async_grpo.in_flight_weight_updates": True},
     "grpo.async_grpo.in_flight_weight_updates=true needs policy.generation.vllm_cfg.async_engine=true"),
    ("in-flight-not-async", {"grpo.async_grpo.in_flight_weight_updates": True,
                             "policy.generation.vllm_cfg.async_engine": True},
     "grpo.async_grpo.in_flight_weight_updates=true needs grpo.async_grpo.enabled=true"),
    ("async-kv-contradiction", {**_ASYNC, "policy.megatron_cfg.mcore_reshard.recompute_kv_cache_after_weight_updates":
                                True}, "contradicts grpo.async_grpo.recompute_kv_cache_after_weight_updates=false"),
    ("unknown-async-key", {"grpo.async_grpo.max_age": 2}, "grpo.async_grpo.max_age"),
    ("truncation-without-correction", {"loss_fn.truncated_importance_sampling_ratio": 2.0},
     "loss_fn.truncated_importance_sampling_ratio=2.0 needs loss_fn.use_importance_sampling_correction=true"),
    ("truncation-negative", {**_ASYNC, "loss_fn.truncated_importance_sampling_ratio": -1.0},
     "loss_fn.truncated_importance_sampling_ratio=-1.0"),
    ("importance-sampling-string", {"loss_fn.use_importance_sampling_correction": "on"},
     "loss_fn.use_importance_sampling_correction"),
    # Megatron-FSDP
    ("fsdp-string", {"policy.megatron_cfg.use_custom_fsdp": "yes"}, "policy.megatron_cfg.use_custom_fsdp"),
    ("fsdp-with-pipeline", {"policy.megatron_cfg.use_custom_fsdp": True, "cluster.gpus_per_node": 5,
                            "policy.megatron_cfg.pipeline_model_parallel_size": 2},
     "Megatron-FSDP with pipeline_model_parallel_size=2"),
]


#: The DTensor recipe's: what the DTensor policy here does not build, or a backend set twice or not at all.
BAD_DTENSOR = [
    ("both", {"policy.megatron_cfg.enabled": True}, "policy.megatron_cfg.enabled=true and policy.dtensor_cfg"),
    ("neither", {"policy.dtensor_cfg.enabled": False}, "policy.megatron_cfg.enabled or policy.dtensor_cfg"),
    ("off", {"policy.dtensor_cfg.mcore_reshard.enabled": False}, "policy.dtensor_cfg.mcore_reshard.enabled"),
    ("moe", {"policy.model_name": "tiny-moe"}, "policy.dtensor_cfg.enabled=true with"),
    ("bf16", {"policy.precision": "bfloat16"}, "policy.precision='bfloat16' with policy.dtensor_cfg"),
    ("cp", {"policy.dtensor_cfg.context_parallel_size": 2}, "policy.dtensor_cfg.context_parallel_size=2"),
    ("tp3", {"policy.dtensor_cfg.tensor_parallel_size": 3}, "policy.dtensor_cfg.tensor_parallel_size=3"),
    ("no-lr", {"policy.optimizer": _DROP}, "policy.optimizer.kwargs.lr"),
]


@pytest.mark.parametrize("base, name, edits, key",
                         [(TINY, *b) for b in BAD] + [(TINY_DTENSOR, *b) for b in BAD_DTENSOR],
                         ids=[b[0] for b in BAD] + [f"dtensor-{b[0]}" for b in BAD_DTENSOR])
def test_bad_recipe_is_one_line(base, name, edits, key, tmp_path, capsys, loop_stub):
    d = yaml.safe_load(base.read_text())
    for path, value in edits.items():
        _edit(d, path, value)
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump(d))
    _one_line_error(capsys, ["grpo", f, "--dry-run"], key)
    _one_line_error(capsys, ["grpo", f], key)  # the run path checks the same, before the loop
    assert loop_stub == []


def test_bad_recipe_files(tmp_path, capsys):
    _one_line_error(capsys, ["grpo", tmp_path / "nope.yaml", "--dry-run"], "nope.yaml")
    _one_line_error(capsys, ["grpo", tmp_path, "--dry-run"], "directory")
    (tmp_path / "list.yaml").write_text("- a\n")
    _one_line_error(capsys, ["grpo", tmp_path / "list.yaml", "--dry-run"], "not a mapping")
    _one_line_error(capsys, ["grpo", "--dry-run"], "recipe")


# --------------------------------------------------------------------------- overrides


def test_overrides_apply(capsys):
    r = load_grpo_recipe(TINY, ["grpo.max_num_steps=3", "grpo.seed=7", "policy.generation.temperature=0.5",
                                "ray.address=auto", "+policy.megatron_cfg.note=hello"])
    assert r.grpo.max_num_steps == 3 and r.grpo.seed == 7 and r.generation.temperature == 0.5
    assert r.ray.address == "auto"
    assert load_grpo_recipe(TINY).grpo.max_num_steps == 12  # the file is untouched
    rep = _json(capsys, ["grpo", str(TINY), "grpo.max_num_steps=3", "--dry-run", "--json"])
    assert rep["max_num_steps"] == 3
    # a key the file lacks but the loader reads, set without '+'
    assert load_grpo_recipe(QWEN_4N, ["env.target_tokens.prompt_length=16"]).task.prompt_length == 16


@pytest.mark.parametrize("override, key", [
    ("grpo.max_num_step=3", "unknown setting grpo.max_num_step"),
    ("policy.megatron_cfg.tensor_model_paralel_size=2", "policy.megatron_cfg.tensor_model_paralel_size"),
    ("+grpo.max_num_steps=3", "grpo.max_num_steps is already a setting"),
    ("grpo.max_num_steps", "not key.path=value"),
    ("grpo.max_num_steps=[1", "not YAML"),
    ("grpo.max_num_steps=three", "grpo.max_num_steps='three'"),
    ("grpo.num_generations_per_prompt=1", "grpo.num_generations_per_prompt=1"),
    ("policy.precision=${nope.x}", "policy.precision"),
])
def test_bad_override_is_one_line(override, key, capsys):
    _one_line_error(capsys, ["grpo", TINY, override, "--dry-run"], key)


def test_grpo_flags_belong_to_grpo(capsys):
    _one_line_error(capsys, ["plan", "--dry-run"], "--dry-run is an option of 'grpo'")
    _one_line_error(capsys, ["refit", "--address", "auto"], "--address is an option of 'grpo'")
    _one_line_error(capsys, ["grpo", TINY, "--recipe", TINY, "--dry-run"], "--recipe")
    _one_line_error(capsys, ["grpo", TINY, "--dry-run", "--address", "auto"], "--address")


def test_hf_broadcast_transport_is_named(capsys):
    rep = _json(capsys, ["grpo", str(TINY), "policy.megatron_cfg.mcore_reshard.transport=hf_broadcast", "--dry-run",
                         "--json"])
    assert rep["transport"] == "hf_broadcast"


def test_lora_recipes_run_where_the_cpu_build_serves_lora_and_refuse_the_baseline_transport(capsys):
    """The tiny LoRA recipe runs here (a dense model); the 30B one plans but says in one line why
    it cannot run here (vLLM's CPU build has no MoE LoRA); the HF-broadcast baseline has no
    adapter path, so a LoRA policy with it is refused naming the key."""
    tiny = load_grpo_recipe(REPO / "recipes" / "grpo-tiny-lora-cpu.yaml")
    assert tiny.local_problem is None and tiny.peft is not None and tiny.peft.dim == 8 and tiny.training.tp == 2
    rep = dry_run(tiny)  # every refit after the first moves what one TP1 engine's slot holds: the whole adapter
    from mcore_reshard.layout.lora import adapter_bytes
    assert rep.lora_refit_bytes == adapter_bytes(tiny.spec, tiny.peft) < rep.plan.bytes_min
    assert "adapter refits (LoRA)" in rep.table() and rep.to_json()["lora_refit_bytes"] == rep.lora_refit_bytes
    big = load_grpo_recipe(REPO / "recipes" / "grpo-qwen3-30b-a3b-4n8g-lora.yaml")
    assert big.peft is not None and "cannot run an engine with LoRA on a MoE model" in big.local_problem
    with pytest.raises(ConfigError, match=r"^policy.megatron_cfg.mcore_reshard.transport='hf_broadcast' with "
                                          r"policy.megatron_cfg.peft.enabled=true: only the reshard transport"):
        load_grpo_recipe(REPO / "recipes" / "grpo-tiny-lora-cpu.yaml",
                         ["policy.megatron_cfg.mcore_reshard.transport=hf_broadcast"])


def test_the_deepseek_v3_recipe_drafts_with_its_mtp_layer_refit_in_the_same_plan():
    """``policy.generation.vllm_cfg.speculative_config`` (vLLM's spelling): the recipe's engines
    draft with the model's MTP layer, whose 1.80 % of the refit is planned, moved and voted on
    with the target (``mcore-reshard plan --recipe`` prints it; the full-size plan runs in the
    docs' commands). Its dry run, on the tiny DeepSeek-V3 with one MTP layer, reports the draft's
    bytes: what every vLLM rank holds of the MTP tensors."""
    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.adapters.vllm.mtp_rules import vllm_draft_rank_params
    from mcore_reshard.adapters.vllm.rules import VllmParallel
    from mcore_reshard.layout import DTYPE_BYTES
    from mcore_reshard.layout.mtp import draft_tensors
    from mcore_reshard.settings.models import tiny_spec

    r = load_grpo_recipe(REPO / "recipes" / "grpo-deepseek-v3-megatron-reshard-mtp.yaml")
    assert r.speculative is not None and r.speculative.method == "mtp" and r.speculative.num_speculative_tokens == 1
    assert r.spec.mtp_layers == 1 and r.training.pp == 8 and r.vllm.tp == 8
    spec = tiny_spec("tiny-deepseek-v3-mtp", "bfloat16")
    tiny = replace(r, spec=spec, model="tiny-deepseek-v3-mtp", training=MegatronParallel(ep=2, pp=1, dp=2),
                   vllm=VllmParallel(tp=1, replicas=2), cluster=replace(r.cluster, num_nodes=1, gpus_per_node=4))
    rep = dry_run(tiny)
    dtypes = {n: dt for n, (_, dt) in draft_tensors(spec).items()}  # bf16, the router's bias fp32
    want = sum(q.box.numel * DTYPE_BYTES[dtypes[q.canonical]] for p in vllm_draft_rank_params(spec, tiny.vllm, 0)
               for q in p.pieces) * 2  # two engines of one rank
    assert rep.draft_bytes == want > 0
    assert "MTP draft" in rep.table() and rep.to_json()["draft_bytes"] == want
