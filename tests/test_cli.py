"""The `mcore-reshard plan` command: JSON keys, numbers that agree, one-line errors with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_reshard.cli import main

REPO = Path(__file__).resolve().parents[1]
KEYS = {"bytes_min", "bytes_planned", "bytes_hf_broadcast", "max_send_bytes", "max_recv_bytes", "num_transfers",
        "num_buckets", "plan_seconds", "not_direct"}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mcore_reshard.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.heavy  # the default full-size plan (Qwen3-30B-A3B, 8 engines)
@pytest.mark.plans("qwen3-30b-a3b")
def test_default_plan_json_is_minimal(capsys):
    rep = plan_json(capsys)
    assert KEYS <= set(rep)
    assert rep["bytes_planned"] == rep["bytes_min"] > 0
    # Qwen3-30B-A3B bf16 on 8 engines of TP2: each engine holds the model once, plus a second
    # copy of what both TP ranks replicate (router, norms).
    model_bytes = rep["bytes_hf_broadcast"] // 16
    H, L, E, D = 2048, 48, 128, 128
    replicated = (L * (E * H + 2 * H + 2 * D) + H) * 2
    assert rep["bytes_min"] == 8 * (model_bytes + replicated)
    assert rep["max_recv_bytes"] == rep["bytes_min"] // 16
    assert rep["not_direct"] == []
    assert rep["dtensor"]["training"].startswith("dtensor form:")


@pytest.mark.heavy  # two full-size plans
@pytest.mark.plans("qwen3-30b-a3b")
def test_recipe_gives_the_same_plan_as_the_default_config(capsys):
    a = plan_json(capsys)
    b = plan_json(capsys, "--recipe", "recipes/grpo-qwen3-30b-a3b-megatron-reshard.yaml")
    assert a["digest"] == b["digest"] and a["bytes_min"] == b["bytes_min"]


@pytest.mark.slow  # a subprocess
def test_console_entry_point_runs():
    out = run_cli("plan", "--json", "model=qwen3-8b", "training.ep=1", "vllm.tp=4", "vllm.replicas=4")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["bytes_planned"] == rep["bytes_min"]


def test_plan_imports_no_runtime():
    """``plan`` works on metadata: the CLI imports torch, megatron, vLLM and Ray only in the
    commands that run processes (a second of a command the planner itself takes ~1 s of)."""
    code = ("import sys; from mcore_reshard.cli import main; main(['plan', '--json', 'model=qwen3-8b', "
            "'training.ep=1', 'vllm.tp=4', 'vllm.replicas=4']); "
            "print(sorted(m for m in ('torch', 'megatron', 'vllm', 'ray') if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "[]"


def test_table_output(capsys):
    assert main(["plan", "model=llama-3.1-8b", "training.ep=1", "training.pp=1", "training.dp=4", "training.tp=4",
                 "vllm.tp=8", "vllm.replicas=2"]) == 0
    text = capsys.readouterr().out
    assert "planned bytes" in text and "(= minimum)" in text and "HF-broadcast baseline bytes" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["model=no-such-model"], "no-such-model"),
        (["training.tp=3"], "num_attention_heads=32 must be a multiple of tp=3"),
        (["training.ep=7"], "ep=7"),
        (["vllm.tp=3"], "tp=3"),
        (["vllm.bogus=1"], "vllm.bogus"),
        (["vllm_model=configs/models/qwen3-235b-a22b.json"], "destination needs"),
        (["vllm_model=configs/models/qwen3-8b.json", "model=qwen3-8b", "vllm.tp=4", "training.ep=1"], None),
        (["refit.transport=carrier-pigeon"], "refit.transport"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message, capsys):
    if message is None:  # control: the same model on both sides plans fine
        assert main(["plan", *args]) == 0
        return
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert message in err


@pytest.mark.parametrize("field, value, tensor", [("vocab_size", 152064, "model.embed_tokens.weight"),
                                                   ("hidden_size", 4096 + 128, "model.embed_tokens.weight")])
def test_mismatched_engine_model_is_named(tmp_path, capsys, field, value, tensor):
    cfg = json.loads((REPO / "configs/models/qwen3-8b.json").read_text())
    cfg[field] = value
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(cfg))
    assert main(["plan", "model=qwen3-8b", "training.ep=1", "vllm.tp=4", f"vllm_model={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert tensor in err and "source shape" in err


def test_config_sections_match_the_dataclasses():
    """Every key of configs/*.yaml's sections is a field of the dataclass it builds, and the refit
    job exposes the sizes it runs (pipeline, replicas) and the commit mode."""
    from dataclasses import fields

    import yaml

    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.adapters.vllm.rules import VllmParallel
    from mcore_reshard.layout.lora import PeftConfig
    from mcore_reshard.settings.policy import RefitConfig
    from mcore_reshard.settings.schema import SpeculativeConfig

    for name in ("plan", "refit"):
        cfg = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
        subs = {"speculative_config"}  # vllm's own sub-section (below)
        for section, cls in (("training", MegatronParallel), ("vllm", VllmParallel), ("refit", RefitConfig)):
            assert set(cfg[section]) - subs <= {f.name for f in fields(cls)}, (name, section)
        assert cfg["refit"]["atomic"] is True
    plan = yaml.safe_load((REPO / "configs" / "plan.yaml").read_text())
    assert set(plan["vllm"]["speculative_config"]) == {f.name for f in fields(SpeculativeConfig)}
    assert set(plan["peft"]) == {f.name for f in fields(PeftConfig)}
    refit = yaml.safe_load((REPO / "configs" / "refit.yaml").read_text())
    assert {"pp", "vpp", "first_stage_layers", "last_stage_layers"} <= set(refit["training"])
    assert refit["vllm"]["replicas"] == 1 and refit["vllm"]["pp"] == refit["vllm"]["dp"] == 1


@pytest.mark.slow  # a subprocess
def test_refit_rejects_bad_input_before_starting_anything():
    """The console entry point: one line, exit 2, in well under the ~35 s a vLLM start takes."""
    import time

    t0 = time.monotonic()
    out = run_cli("refit", "refit.buffer_bytes=1")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().startswith("error: refit.buffer_bytes=1") and "\n" not in out.stderr.strip()
    assert time.monotonic() - t0 < 20
