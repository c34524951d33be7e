"""Every bad input is one line ``error: ...`` naming the setting, exit 2, nothing on stdout,
before any process starts or any file is written (``mcore-reshard plan|refit``, ``--recipe``).

``refit`` never reaches the job here: ``mcore_reshard.jobs.refit`` is replaced by a stub that fails
the test if it is called, and no child process may appear.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
import time
from pathlib import Path

import pytest
import yaml

from mcore_reshard.cli import main
from support import PROCESS_STARTS
from support.background import BACKGROUND
from mcore_reshard.settings.config import MAX_PLAN_TRANSFERS, RefitJob, load_refit_job
from mcore_reshard.settings.limits import cpu_has_amx
from mcore_reshard.errors import ConfigError
from mcore_reshard.layout import LayoutError
from mcore_reshard.settings.policy import MAX_BUFFER_BYTES, MIN_BUFFER_BYTES, RefitConfig
from mcore_reshard.wire.protocol import VerifyMode

try:
    import psutil
except ImportError:  # pragma: no cover - psutil comes with vllm
    psutil = None

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "grpo-qwen3-30b-a3b-megatron-reshard.yaml"


@pytest.fixture
def no_job(monkeypatch):
    """The CLI's ``run_refit_job`` as a stub: the CLI's refit gets a RefitJob and starts nothing
    (the CLI imports it from ``jobs.refit`` when a refit runs)."""
    import mcore_reshard.jobs.refit as cli

    calls = []

    def run_refit_job(job, *, as_json=False):
        calls.append((job, as_json))
        return 0

    monkeypatch.setattr(cli, "run_refit_job", run_refit_job)
    return calls


def _children() -> set[int]:
    """This process's descendants, less the session's background jobs and theirs (a GRPO CLI
    run started by ``support.background`` spawns its own ranks whenever it gets to them)."""
    if psutil is None:
        return {p.pid for p in multiprocessing.active_children()}
    jobs = {p.pid for p in BACKGROUND.procs}
    mine = set()
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if p.pid in jobs or any(a.pid in jobs for a in p.parents()):
                continue
        except psutil.Error:
            continue  # gone meanwhile
        mine.add(p.pid)
    return mine


def check_one_line(capsys, argv, key, *, limit_s=20.0):
    with PROCESS_STARTS:  # the warm worlds start no process meanwhile
        before = _children()
        t0 = time.monotonic()
        rc = main(argv)
        seconds = time.monotonic() - t0
        after = _children()
    out, err = capsys.readouterr()
    assert rc == 2, (argv, rc, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].strip() != "error:", (argv, err)
    assert key in lines[0], (argv, key, lines[0])
    assert "'None'" not in lines[0], lines[0]  # a missing key is named, never shown as model 'None'
    assert out == "", (argv, out)
    if seconds > limit_s:  # no wall-time assertion (shared machines are noisy); say it
        print(f"note: {argv} took {seconds:.1f}s")
    assert after <= before, (argv, "started a process")
    return lines[0]


# (arguments after the command, text the error line must contain: the offending key)
PLAN_CASES = [
    (["training.tp=two"], "training.tp='two' is not an integer"),
    (["vllm.tp=1.5"], "vllm.tp=1.5 is not an integer"),
    (["training.tp=true"], "training.tp=True is not an integer"),
    (["training.sequence_parallel=yes"], "training.sequence_parallel"),
    (["+bogus=1"], "bogus"),
    (["+training.bogus=1"], "training.bogus"),
    (["training.foo=1"], "training.foo"),
    (["+training.tp=3"], "training.tp"),
    (["~training.tp"], "training.tp"),
    (["training.tp=[1"], "training.tp"),
    (["training.tp=${nope}"], "training.tp"),
    (["refit.buffer_bytes=10**21"], "refit.buffer_bytes"),
    (["refit.buffer_bytes=1000000000000000000000"], "refit.buffer_bytes"),
    (["refit.buffer_bytes=4"], "refit.buffer_bytes=4"),
    (["refit.buffer_bytes=65536"], "refit.buffer_bytes=65536 is too small"),  # 30B model: 15M transfers
    (["refit.timeout_s=0"], "refit.timeout_s"),
    (["refit.verify=ful"], "refit.verify='ful'"),
    (["refit.atomic=sometimes"], "refit.atomic"),
    (["dtype=float13"], "dtype='float13'"),
    (["training.pp=0"], "training.pp=0"),
    (["training.etp=0"], "training.etp=0"),
    (["vllm.replicas=0"], "vllm.replicas=0"),
    (["vllm.num_redundant_experts=-1"], "vllm.num_redundant_experts"),
    (["training.layer_spec=xla"], "training.layer_spec"),
    (["vllm.expert_placement=random"], "vllm.expert_placement"),
    (["training.dp=100000000"], "training world"),
    (["training.tp=3"], "num_attention_heads=32 must be a multiple of tp=3"),
    (["model=no-such-model"], "model='no-such-model'"),
    (["model=123"], "model=123"),
    (["vllm_model=no-such-model"], "vllm_model='no-such-model'"),
    (["vllm.quantization=fp8"], "vllm.quantization='fp8' is not one of [None, 'fp8_per_block']"),
    # Qwen3-30B-A3B's 768 expert rows over vLLM TP8: 96 per rank cut a 128-row FP8 block
    (["vllm.quantization=fp8_per_block", "vllm.tp=8", "vllm.replicas=2"],
     "mlp.experts.0.gate_proj.weight: vllm rank 0 holds rows [0, 96)"),
]

REFIT_CASES = [
    (["training.tp=two"], "training.tp='two' is not an integer"),
    (["vllm.tp=1.5"], "vllm.tp=1.5"),
    (["+bogus=1"], "bogus"),
    (["+refit.foo=1"], "refit.foo"),
    (["+job.foo=1"], "job.foo"),
    (["training.foo=1"], "training.foo"),
    (["refit.buffer_bytes=10**21"], "refit.buffer_bytes"),
    (["refit.buffer_bytes=1000000000000000000000"], "refit.buffer_bytes"),
    (["refit.buffer_bytes=4"], "refit.buffer_bytes=4"),
    (["refit.buffer_bytes=1"], "refit.buffer_bytes=1"),
    (["refit.buffer_bytes=-1"], "refit.buffer_bytes=-1"),
    (["refit.buffer_bytes=abc"], "refit.buffer_bytes='abc'"),
    (["dtype=float13"], "dtype='float13'"),
    (["dtype=int8"], "dtype='int8'"),
    (["refit.timeout_s=0"], "refit.timeout_s"),
    (["refit.timeout_s=-1"], "refit.timeout_s"),
    (["refit.timeout_s=nan"], "refit.timeout_s"),
    (["refit.timeout_s=inf"], "refit.timeout_s"),
    (["refit.timeout_s=soon"], "refit.timeout_s"),
    (["refit.verify=ful"], "refit.verify='ful'"),
    (["refit.transport=x"], "refit.transport='x'"),
    (["refit.apply_mode=y"], "refit.apply_mode='y'"),
    (["refit.atomic=2"], "refit.atomic"),
    (["refit.overlap=maybe"], "refit.overlap"),
    (["refit.overlap=true", "refit.atomic=false"], "refit.overlap=true needs refit.atomic=true"),
    (["refit.overlap=true", "refit.transport=hf_broadcast"], "refit.overlap=true needs refit.transport=reshard"),
    (["refit.max_shadow_bytes=-1"], "refit.max_shadow_bytes=-1"),
    (["refit.delta=sometimes"], "refit.delta='sometimes'"),
    (["refit.delta_state_limit_bytes=-1"], "refit.delta_state_limit_bytes=-1"),
    (["training.pp=0"], "training.pp=0"),
    (["training.tp=3"], "tp=3"),
    (["training.pp=3"], "training layout"),  # 4 layers do not split over 3 stages
    (["model=no-such-model"], "model='no-such-model'"),
    (["model=tiny-dense"], "expert_model_parallel_size=2"),  # training.ep=2 on a dense model
    (["job.steps=0"], "job.steps=0"),
    (["job.steps=one"], "job.steps"),
    (["job.lr=0"], "job.lr"),
    (["job.lr=nan"], "job.lr"),
    (["job.tokens=[1,1000]"], "job.tokens[1]=1000"),
    (["job.tokens=[-1]"], "job.tokens[0]=-1"),
    (["job.tokens=[]"], "job.tokens"),
    (["job.tokens=5"], "job.tokens"),
    (["job.tokens=[1,a]"], "job.tokens[1]"),
    (["job.compare_hf=maybe"], "job.compare_hf"),
    (["seed=-1"], "seed=-1"),
    (["vllm.pp=2"], "vllm.pp/vllm.dp > 1: one engine per replica with pp=dp=1 runs on this machine"),
    (["vllm.dp=2"], "vllm.dp=2"),
    (["vllm.enable_ep=true"], "vllm.enable_ep"),
    (["training.layer_spec=te"], "training.layer_spec='te'"),
    (["training.experts=grouped"], "training.experts='grouped'"),
    (["training.dp=1000"], "training world"),
    (["vllm.replicas=0"], "vllm.replicas=0"),
    (["refit.enabled=false"], "refit.enabled"),
    (["--recipe", str(RECIPE)], "--recipe"),
    (["vllm.quantization=fp8"], "vllm.quantization='fp8'"),
    # An FP8 engine starts where vLLM's CPU FP8 kernels run (AMX tiles); anywhere, a model the
    # user named whose shards cut 128x128 blocks is refused in one line.
    (["model=tiny-moe-128", "vllm.quantization=fp8_per_block"], "vLLM's CPU FP8 kernels need AMX tiles")
    if not cpu_has_amx() else (["model=tiny-moe", "vllm.quantization=fp8_per_block"], "cuts a 128x128 FP8 block"),
]


@pytest.mark.parametrize("args, key", PLAN_CASES, ids=[" ".join(a) for a, _ in PLAN_CASES])
def test_plan_bad_input(args, key, capsys):
    check_one_line(capsys, ["plan", *args], key)
    check_one_line(capsys, ["plan", "--json", *args], key)


@pytest.mark.parametrize("args, key", REFIT_CASES, ids=[" ".join(a) for a, _ in REFIT_CASES])
def test_refit_bad_input_starts_nothing(args, key, capsys, no_job):
    check_one_line(capsys, ["refit", *args], key, limit_s=10.0)
    assert no_job == []


def test_tiny_buffer_is_rejected_at_once(capsys):
    """``plan refit.buffer_bytes=4`` used to grow past 6 GiB planning 4-byte buckets."""
    t0 = time.monotonic()
    check_one_line(capsys, ["plan", "refit.buffer_bytes=4"], "refit.buffer_bytes=4")
    assert time.monotonic() - t0 < 5.0


@pytest.mark.parametrize("argv, key", [
    (["bogus"], "bogus"),
    (["plan", "--nope"], "--nope"),
    ([], "command"),
    (["plan", "--recipe", str(RECIPE), "vllm.tp=4"], "--recipe"),
])
def test_bad_command_line(argv, key, capsys):
    check_one_line(capsys, argv, key)


# --------------------------------------------------------------------------- recipes


def _recipe() -> dict:
    return yaml.safe_load(RECIPE.read_text())


def _edit(path: str, value):
    def apply(d):
        *parents, leaf = path.split(".")
        node = d
        for p in parents:
            node = node[p]
        if value is _DROP:
            del node[leaf]
        else:
            node[leaf] = value
    return apply


_DROP = object()
RECIPE_CASES = [
    ("not-yaml", "a: b: c\n", "is not YAML"),
    ("binary", b"\x00\x01\x02\xff binary", "recipe"),
    ("list", "- a\n- b\n", "not a mapping"),
    ("scalar", "hello\n", "not a mapping"),
    ("empty", "", "not a mapping"),
    ("no-model", [_edit("policy.model_config", _DROP), _edit("policy.model_name", _DROP)], "policy.model_config is missing"),
    ("no-cluster-nodes", [_edit("cluster.num_nodes", _DROP)], "cluster.num_nodes is missing"),
    ("no-generation-resources", [_edit("policy.generation.colocated.resources", _DROP)],
     "policy.generation.colocated.resources.gpus_per_node is missing"),
    ("no-megatron-cfg", [_edit("policy.megatron_cfg", _DROP)],
     "policy.megatron_cfg.enabled or policy.dtensor_cfg.enabled must be true"),
    ("generation-takes-every-gpu", [_edit("policy.generation.colocated.resources.num_nodes", 4)],
     "policy.generation.colocated.resources"),
    ("generation-more-gpus-per-node", [_edit("policy.generation.colocated.resources.gpus_per_node", 16)],
     "policy.generation.colocated.resources.gpus_per_node=16"),
    ("vllm-ep-contradicts-tp", [_edit("policy.generation.vllm_cfg.expert_parallel_size", 3)],
     "expert_parallel_size=3"),
    ("tp-two", [_edit("policy.megatron_cfg.tensor_model_parallel_size", "two")],
     "policy.megatron_cfg.tensor_model_parallel_size='two'"),
    ("verify-ful", [_edit("policy.megatron_cfg.mcore_reshard.verify", "ful")],
     "policy.megatron_cfg.mcore_reshard.verify='ful'"),
    ("atomic-yes-string", [_edit("policy.megatron_cfg.mcore_reshard.atomic", "yes")],
     "policy.megatron_cfg.mcore_reshard.atomic"),
    ("buffer-4", [_edit("policy.megatron_cfg.mcore_reshard.buffer_bytes", 4)],
     "policy.megatron_cfg.mcore_reshard.buffer_bytes=4"),
    ("unknown-key", [_edit("policy.megatron_cfg.mcore_reshard.bogus", 1)], "policy.megatron_cfg.mcore_reshard.bogus"),
    ("no-such-model", [_edit("policy.model_config", "no-such-model")], "policy.model_config='no-such-model'"),
    ("bad-precision", [_edit("policy.precision", "float13")], "policy.precision='float13'"),
    ("interpolation", [_edit("policy.precision", "${nope.x}")], "policy.precision"),
    ("tp-3", [_edit("policy.megatron_cfg.tensor_model_parallel_size", 3)], "tensor_model_parallel_size"),
]


@pytest.mark.parametrize("name, content, key", RECIPE_CASES, ids=[c[0] for c in RECIPE_CASES])
def test_recipe_bad_input(name, content, key, tmp_path, capsys):
    path = tmp_path / f"{name}.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        d = _recipe()
        for edit in content:
            edit(d)
        path.write_text(yaml.safe_dump(d))
    check_one_line(capsys, ["plan", "--recipe", str(path)], key)


def test_recipe_file_missing_or_a_directory(tmp_path, capsys):
    check_one_line(capsys, ["plan", "--recipe", str(tmp_path / "nope.yaml")], "nope.yaml")
    check_one_line(capsys, ["plan", "--recipe", str(tmp_path)], "directory")


# --------------------------------------------------------------------------- the good path


def test_refit_cli_hands_a_checked_job_to_run_refit_job(capsys, no_job):
    assert main(["refit", "--json", "refit.verify=full", "refit.atomic=false", "job.tokens=[0,999]"]) == 0
    (job, as_json), = no_job
    assert as_json is True and isinstance(job, RefitJob)
    assert job.refit.verify is VerifyMode.FULL and job.refit.atomic is False
    assert job.tokens == (0, 999)


def test_load_refit_job_defaults():
    job = load_refit_job([])
    assert job.model == "tiny-moe" and job.tiny and job.checkpoint is None
    assert job.spec.vocab == 1000 and job.spec.num_experts == 8 and job.spec.dtype == job.dtype == "bfloat16"  # the demo trains and serves bf16
    assert (job.training.tp, job.training.ep, job.vllm.tp, job.vllm.replicas) == (2, 2, 2, 1)
    assert job.refit.verify is VerifyMode.CHECKSUM and job.refit.atomic is True
    assert job.refit.bucket_bytes == job.refit.buffer_bytes // 2
    assert job.steps == 1 and isinstance(job.lr, float) and job.compare_hf is True and job.workdir is None
    assert all(isinstance(t, int) for t in job.tokens)
    assert job.plan is not None and job.plan.bytes_planned == job.plan.bytes_min
    with pytest.raises(Exception):
        job.steps = 2  # frozen


@pytest.mark.parametrize("args", [["training.pp=2"], ["training.pp=2", "training.vpp=2"],
                                  ["training.pp=2", "training.first_stage_layers=1", "training.last_stage_layers=3"],
                                  ["vllm.replicas=2"], ["model=tiny-dense", "training.ep=1"],
                                  ["refit.buffer_bytes=65536"], ["refit.verify=off", "refit.atomic=false"]])
def test_refit_job_accepts_what_the_lead_runs(args):
    job = load_refit_job(args)
    assert job.plan is not None


def test_refit_job_errors_are_config_or_layout_errors():
    with pytest.raises(ConfigError, match="refit.verify"):
        load_refit_job(["refit.verify=ful"])
    with pytest.raises(LayoutError, match="tp=3"):
        load_refit_job(["training.tp=3"])
    assert issubclass(ConfigError, ValueError) and issubclass(LayoutError, ValueError)


def test_refit_config_types():
    rc = RefitConfig(verify="full", timeout_s=5)
    assert rc.verify is VerifyMode.FULL and rc.verify == "full" and rc.timeout_s == 5.0 and rc.atomic is True
    assert RefitConfig(buffer_bytes=MIN_BUFFER_BYTES).bucket_bytes == MIN_BUFFER_BYTES // 2
    RefitConfig(buffer_bytes=MAX_BUFFER_BYTES)
    for bad in (dict(verify="ful"), dict(buffer_bytes=MIN_BUFFER_BYTES - 1), dict(buffer_bytes=MAX_BUFFER_BYTES + 1),
                dict(buffer_bytes=True), dict(buffer_bytes=1.5e6), dict(timeout_s=math.nan), dict(timeout_s=0),
                dict(atomic="yes"), dict(transport="x"), dict(apply_mode="y")):
        with pytest.raises(ConfigError):
            RefitConfig(**bad)
    assert MAX_PLAN_TRANSFERS > 328_000  # the largest plan benchmarked fits


def test_recipe_atomic_maps_to_refit_config(tmp_path, capsys):
    d = _recipe()
    d["policy"]["megatron_cfg"]["mcore_reshard"]["atomic"] = False
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(d))
    from mcore_reshard.settings.policy import load_recipe_file

    assert load_recipe_file(path).refit.atomic is False
    assert load_recipe_file(RECIPE).refit.atomic is True
    assert json.dumps({"verify": load_recipe_file(RECIPE).refit.verify}) == '{"verify": "checksum"}'



@pytest.mark.heavy  # writes five HF checkpoints (imports transformers)
def test_tiny_specs_match_the_written_checkpoints(tmp_path):
    """load_refit_job builds a tiny model's spec from its config dict, writing nothing: it must
    equal the spec of the checkpoint the job writes later."""
    from mcore_reshard.settings.config import TINY_MODELS
    from mcore_reshard.layout import load_model_spec

    try:
        from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
    except ImportError:
        from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
    from mcore_reshard.settings import tiny_spec
    from mcore_reshard.settings.models import megatron_build_problem

    for name, family in TINY_MODELS.items():
        args = [] if family == "qwen3_moe" else ["training.ep=1"]
        if tiny_spec(name, "float32").hybrid is not None:  # planned, not trained by the local job
            ckpt = make_tiny_checkpoint(tmp_path / name, family=family, dtype="float32")
            assert load_model_spec(ckpt, dtype="float32") == tiny_spec(name, "float32"), name
            for model in (name, ckpt):  # refused in one line, before anything starts
                with pytest.raises(ConfigError, match=f"model={model}: the local job trains ") as exc:
                    load_refit_job([f"model={model}", *args])
                assert "\n" not in str(exc.value)
            continue
        problem = megatron_build_problem(tiny_spec(name, "float32"))
        if problem is not None:  # a family megatron-core builds no model of (the Qwen VL ones): planned only
            ckpt = make_tiny_checkpoint(tmp_path / name, family=family, dtype="float32")
            assert load_model_spec(ckpt, dtype="float32") == tiny_spec(name, "float32"), name
            for model in (name, ckpt):
                with pytest.raises(ConfigError, match=re.escape(problem)) as exc:
                    load_refit_job([f"model={model}", *args])
                assert "\n" not in str(exc.value)
            continue
        job = load_refit_job([f"model={name}", *args])
        ckpt = make_tiny_checkpoint(tmp_path / name, family=family, dtype=job.dtype)
        assert load_model_spec(ckpt, dtype=job.dtype) == job.spec, name
        assert load_refit_job([f"model={ckpt}", *args]).checkpoint == ckpt


def test_refit_job_with_a_draft_plans_it_with_the_target_or_says_why_not_in_one_line():
    """``vllm.speculative_config`` in ``configs/refit.yaml``: the draft's layouts join the
    target's plan (one refit, one vote); a model without MTP layers, the HF baseline (its
    loader leaves the draft stale) and a TP the draft layout does not describe are refused."""
    from mcore_reshard.layout.mtp import draft_tensors

    mtp = ["model=tiny-deepseek-v3-mtp", "vllm.tp=1", "vllm.speculative_config.method=mtp", "job.compare_hf=false"]
    job = load_refit_job(mtp)
    assert job.speculative.method == "mtp" and job.spec.mtp_layers == 1
    moved = {t.canonical for t in job.plan.transfers}
    assert set(draft_tensors(job.spec)) <= moved and job.plan.bytes_planned == job.plan.bytes_min
    with pytest.raises(ConfigError, match=r"^job.compare_hf=true with vllm.speculative_config: the HF-broadcast"):
        load_refit_job(mtp[:-1] + ["job.compare_hf=true"])  # named: kept, and refused
    # what the overrides leave unnamed is chosen for the draft, and said in one line
    chosen = load_refit_job(["vllm.speculative_config.method=mtp"])
    assert (chosen.model, chosen.vllm.tp, chosen.compare_hf) == ("tiny-deepseek-v3-mtp", 1, False)
    assert "\n" not in chosen.chose and "chose model=tiny-deepseek-v3-mtp, vllm.tp=1, job.compare_hf=false" in chosen.chose
    assert load_refit_job(mtp).chose == "" and load_refit_job([]).chose == ""
    with pytest.raises(ConfigError, match=r"^vllm.speculative_config.method=mtp: the local job drafts with vllm.tp=1"):
        load_refit_job(mtp[:1] + ["vllm.tp=2"] + mtp[2:])
    with pytest.raises(LayoutError, match=r"the model has no MTP layers"):
        load_refit_job(["model=tiny-moe", "vllm.tp=1", "vllm.speculative_config.method=mtp", "job.compare_hf=false"])


@pytest.mark.skipif(not cpu_has_amx(), reason="the local job refuses FP8 engines without AMX tiles (the case above)")
def test_refit_job_for_an_fp8_engine_chooses_a_block_shaped_model_and_says_so():
    """``vllm.quantization=fp8_per_block`` on the default job: the built-in model whose shards
    are whole 128x128 blocks on both sides is chosen, in one line; the plan quantizes at the
    senders, at the FP8 minimum. A model the user names is kept (and refused if it cuts
    blocks: the case above)."""
    job = load_refit_job(["vllm.quantization=fp8_per_block"])
    assert job.model == "tiny-moe-128" and "\n" not in job.chose
    assert job.chose.startswith("vllm.quantization=fp8_per_block: chose model=tiny-moe-128")
    assert job.plan.quantized and job.plan.quantized_at_receiver == () and job.plan.bytes_planned == job.plan.bytes_min
    assert load_refit_job(["model=tiny-dense-128", "training.ep=1", "vllm.quantization=fp8_per_block"]).chose == ""
