"""Every ``mcore-reshard plan`` command the docs show plans, and the layouts the planner used to
refuse for a performance reason plan at the per-rank minimum: fan-out relays meet the
one-copy-per-node floor, or the plan keeps the direct path for what they cannot and its notes
say so -- a performance miss is never an error."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from mcore_reshard.cli import main
from mcore_reshard.settings.config import load_plan, side_layouts
from mcore_reshard.plan.placed import placement_report, plan_for_placement

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
_PLAN = re.compile(r"(?:^|[\s/])mcore-reshard plan(?=\s|$)(.*)$")


def doc_plan_commands() -> list[tuple[str, list[str]]]:
    """(where, arguments after ``plan``) of every ``mcore-reshard plan`` line in the docs'
    code blocks, shell comments dropped."""
    out = []
    for path in DOCS:
        for block in _FENCE.findall(path.read_text()):
            for line in block.splitlines():
                m = _PLAN.search(line)
                if m:
                    args = shlex.split(m.group(1), comments=True)
                    out.append((f"{path.name}: mcore-reshard plan {' '.join(args)}".strip(), args))
    return out


COMMANDS = doc_plan_commands()
#: The docs' DeepSeek-V3 command (a full-size plan of ~25 s: planned once, by the floor test).
DEEPSEEK_V3 = ["model=deepseek-v3", "training.pp=16", "training.first_stage_layers=3", "training.last_stage_layers=2",
               "training.ep=64", "training.dp=64", "vllm.tp=8", "vllm.replicas=8", "vllm.enable_ep=true"]

#: Full-size MoE plans take 10-40 s each on one core (``heavy``: not in make test-fast); the
#: dense qwen3-8b one about one.
_FAST = ("model=qwen3-8b",)


def test_the_docs_show_plan_commands():
    where = [w for w, _ in COMMANDS]
    assert len(COMMANDS) >= 6, where
    assert any("model=deepseek-v3" in w and "vllm.enable_ep=true" in w for w in where)
    assert any(args == [] for _, args in COMMANDS)  # the default
    assert any(a in w for w in where for a in _FAST)


#: Doc commands whose full-size plan other tests make too (``plans(key)``: they run next to
#: those, and the plan is made once); every other command is a group of its own, its plans
#: cleared after it.
SHARED_PLANS = {
    "": "qwen3-30b-a3b",  # test_cli.py's default plan
    "--recipe recipes/grpo-qwen3-30b-a3b-megatron-reshard.yaml": "qwen3-30b-a3b",
    "--recipe recipes/grpo-qwen3-30b-a3b-4n8g-lora.yaml": "qwen3-30b-a3b-4n8g",
    "topology.placement=colocated training.pp=1 training.dp=32 vllm.replicas=16": "qwen3-30b-a3b-4n8g",
    "--recipe recipes/grpo-glm-4.5-32n8g-megatron-reshard.yaml": "glm-4.5-32n8g",  # test_families.py's dry run
    "vllm.quantization=fp8_per_block": "qwen3-30b-a3b-fp8",  # test_grpo_recipe.py's FP8 dry run
    "--recipe recipes/grpo-qwen3-30b-a3b-megatron-fsdp.yaml": "qwen3-30b-a3b-megatron-fsdp",  # and its FSDP one
}


def _marks(where: str, args: list[str]) -> list:
    heavy = [] if any(a in args for a in _FAST) else [pytest.mark.heavy]
    return [*heavy, pytest.mark.plans(SHARED_PLANS.get(" ".join(args), where))]


@pytest.mark.parametrize("args", [
    pytest.param(args, id=where, marks=_marks(where, args))
    for where, args in COMMANDS if args != DEEPSEEK_V3  # that one: test_deepseek_v3_readme_layout_meets_the_floor
])
def test_doc_plan_command_plans(args, capsys, monkeypatch):
    """Through the CLI's own entry point, in-process, from the checkout (``--recipe`` paths
    are relative to it). Its plans are cleared after it, or after the last test that shares
    them (``SHARED_PLANS``)."""
    monkeypatch.chdir(ROOT)
    rc = main(["plan", *args])
    err = capsys.readouterr().err
    assert rc == 0 and "error" not in err, err


def _plan(overrides: list[str]):
    """The CLI's plan for ``overrides``: layouts, the placement's plan and its report."""
    recipe = load_plan(overrides)
    src, dst = side_layouts(recipe.spec, recipe.training, recipe.vllm, recipe.refit, recipe.vllm_spec)
    where = recipe.topology.place(src.world_size, dst.world_size)
    plan = plan_for_placement(src, dst, where, recipe.topology.links, bucket_bytes=recipe.refit.bucket_bytes,
                              allow_cast=recipe.refit.allow_cast)
    return plan, placement_report(plan, src, dst, where, recipe.topology.links)


QWEN3_235B_EPLB = ["model=qwen3-235b-a22b", "training.tp=1", "training.pp=4", "training.first_stage_layers=1",
                   "training.last_stage_layers=3", "training.ep=2", "training.dp=2", "vllm.tp=1", "vllm.pp=2",
                   "vllm.dp=4", "vllm.enable_ep=true", "vllm.num_redundant_experts=8"]


@pytest.mark.heavy
@pytest.mark.plans("qwen3-235b-eplb")  # its layouts, kept for the next test's
def test_redundant_expert_copies_meet_the_floor():
    """vLLM EPLB's 8 redundant slots hold experts 0..7 a second time on another rank of each
    node: relays count that rank as a second holder of the same box, so the box crosses into
    the node once. (It was refused: expert 0 crossed into node 1 twice.) With buckets of 2 GiB
    every relay fits the executor's message tags and the fabric carries exactly the floor."""
    plan, rep = _plan([*QWEN3_235B_EPLB, "refit.buffer_bytes=4294967296"])
    assert plan.bytes_planned == plan.bytes_min
    assert rep.bytes_inter_node == rep.bytes_inter_node_min
    assert plan.relay_sites and any(".experts.0.down_proj." in site[2] for box in plan.relay_sites for site in box)
    assert not any("direct path" in n or "not used" in n for n in plan.notes)


@pytest.mark.heavy
@pytest.mark.plans("qwen3-235b-eplb")
def test_redundant_expert_copies_with_the_default_buffer(capsys):
    """With 512 MiB buckets the busiest trainer alone needs ~1700 rounds: relaying the EPLB
    copies too would need more message tags than gloo has, so those copies keep the direct
    path, every other box is relayed, and the notes say so."""
    plan, rep = _plan(QWEN3_235B_EPLB)
    assert plan.bytes_planned == plan.bytes_min
    assert plan.relay_groups
    assert rep.bytes_inter_node_min < rep.bytes_inter_node
    (note,) = [n for n in plan.notes if "keep the direct path" in n]
    assert "redundant expert copies" in note and "message tags" in note
    # What bytes_min counts (a reviewer read 8x too much into it): vllm.dp=4 is vLLM's
    # data_parallel_size inside one engine, and configs/plan.yaml's vllm.replicas=8 still
    # applies, so the plan is 8 engines x 8 ranks, and bytes_min (summed over destination
    # ranks) is 8x one engine's, checked against a computation by hand (the same plan, cached).
    from test_plan_topology import _qwen3_moe_ep_rank_bytes

    cfg = json.loads((Path(__file__).resolve().parents[1] / "configs/models/qwen3-235b-a22b.json").read_text())
    one_engine = _qwen3_moe_ep_rank_bytes(
        hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], vocab=cfg["vocab_size"],
        heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        experts=cfg["num_experts"], moe_intermediate=cfg["moe_intermediate_size"], pp=2, dp=4, redundant=8,
        itemsize=2)
    assert sum(one_engine) == 556_515_061_760
    assert main(["plan", "--json", *QWEN3_235B_EPLB]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_dst_ranks"] == 64
    assert out["bytes_min"] == out["bytes_planned"] == 8 * sum(one_engine) == 4_452_120_494_080
    assert out["max_recv_bytes"] == max(one_engine)
    assert out["destination"] == {
        "engines": 8, "ranks_per_engine": 8, "ranks": 64, "bytes_min_per_engine": sum(one_engine),
        "bytes_min_counts": "every destination rank of every engine, summed "
                            "(vllm.replicas x vllm.dp x vllm.pp x vllm.tp ranks)"}


@pytest.mark.heavy
@pytest.mark.plans("deepseek-v3-readme")
def test_deepseek_v3_readme_layout_meets_the_floor(capsys):
    """The README's DeepSeek-V3 command: its fp32 router bias, carried as bf16 bits, is
    relayed inside each node (it reached one rank per node only, so the plan was refused for
    delivering fewer bytes than the destinations hold)."""
    assert any(args == DEEPSEEK_V3 for _, args in COMMANDS)  # the docs show it
    plan, rep = _plan(DEEPSEEK_V3)
    assert main(["plan", *DEEPSEEK_V3]) == 0  # and the CLI plans it (the same plan, cached)
    assert "error" not in capsys.readouterr().err
    assert plan.bytes_planned == plan.bytes_min
    assert rep.bytes_inter_node == rep.bytes_inter_node_min
    bias = dict(plan.reinterpret)
    assert bias and any(g >= 0 for t, g in zip(plan.transfers, plan.relay_of) if t.canonical in bias)
    assert not any("direct path" in n or "not used" in n for n in plan.notes)
