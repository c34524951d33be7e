"""Live vLLM (CPU) checks of the recorded destination pieces and the apply path.

Each class takes its engine from the session's cache (``class_engine``: one engine per
architecture, dtype, TP, EP and apply mode; each start costs 15-25 s): the tiny MoE TP2 and TP1
ones are still warm from the refit modules that run just before (``LIVE_ORDER``), so their
classes come first. Every
check here holds for whatever weights a shared engine holds when it arrives: recordings are
compared with the rules, and refits load this module's own checkpoints first.
"""

from __future__ import annotations

import hashlib

import pytest

torch = pytest.importorskip("torch")

from mcore_reshard.adapters.vllm.engine import after_refit, describe, greedy  # noqa: E402
from mcore_reshard.layout.descriptor import LocalParam  # noqa: E402
from mcore_reshard.layout.spec import load_model_spec  # noqa: E402
from mcore_reshard.transport.views import materialize_local  # noqa: E402
from mcore_reshard.infra.checkpoint import load_canonical, make_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    """Imported when these tests run, not when the suite is collected (vLLM takes ~10 s)."""
    pytest.importorskip("vllm")

#: vLLM's CPU attention supports head sizes >= 32 only.
PROMPTS = [[1, 5, 9, 200, 17], [3, 4, 5], [700, 12, 999, 42, 8, 8]]
MAX_TOKENS = 6


def _norm_view(view, box):
    """Strides of size-1 dims are arbitrary; compare the rest."""
    return view.offset, view.shape, tuple(s if n > 1 else 0 for n, s in zip(view.shape, view.stride))


def _as_sets(params: list[LocalParam]):
    pieces = {(p.local_name, p.canonical, p.box, _norm_view(p.view, p.box)) for lp in params for p in lp.pieces}
    shapes = {lp.name: tuple(lp.shape) for lp in params}
    return pieces, shapes


def _hf_greedy(path, prompts, n):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


def _check_against_rules(path, params_per_worker, infos, *, tp, enable_ep=False):
    from mcore_reshard.adapters.vllm import VllmParallel, vllm_rank_params

    spec = load_model_spec(path, dtype="float32")
    par = VllmParallel(tp=tp, enable_ep=enable_ep)
    for params, info in zip(params_per_worker, infos):
        expected = vllm_rank_params(spec, par, info["rank"])
        got_pieces, got_shapes = _as_sets(params)
        exp_pieces, exp_shapes = _as_sets(expected)
        assert got_shapes == exp_shapes, f"rank {info['rank']}: local shapes differ"
        assert got_pieces == exp_pieces, (
            f"rank {info['rank']}: only recorded {sorted(got_pieces - exp_pieces)[:3]}, "
            f"only in rules {sorted(exp_pieces - got_pieces)[:3]}"
        )


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_live")
    out = {}
    for moe in (False, True):
        kind = "moe" if moe else "dense"
        a = make_tiny_checkpoint(root / f"{kind}_a", moe=moe, seed=0)
        b = make_tiny_checkpoint(root / f"{kind}_b", moe=moe, seed=1)
        c = make_tiny_checkpoint(root / f"{kind}_c", moe=moe, seed=2)
        out[kind] = (a, b, c, _hf_greedy(b, PROMPTS, MAX_TOKENS))
    return out


def _refit_and_check(llm, path, hf_expected):
    statuses = llm.collective_rpc("mr_load_canonical", args=(str(path),))
    assert all(s["state"] == "serving" for s in statuses), statuses
    after_refit(llm)
    assert greedy(llm, PROMPTS, MAX_TOKENS) == hf_expected


class _MoeRefit:
    """CPU MoE prepacks w13/w2: reload path plus the re-prepack vLLM 0.32 forgets."""

    TP = 1

    @pytest.fixture(scope="class")
    def llm(self, class_engine, ckpts):
        return class_engine(ckpts["moe"][0], tp=self.TP)

    def test_recording_matches_rules(self, llm, ckpts):
        before = greedy(llm, PROMPTS, MAX_TOKENS)
        infos = llm.collective_rpc("mr_rank_info")
        params = describe(llm)  # records (first call)
        assert greedy(llm, PROMPTS, MAX_TOKENS) == before  # prepacked MoE weights untouched
        w13 = [lp for lp in params[0] if lp.name.endswith("w13_weight")]
        assert w13 and len(w13[0].pieces) == 2 * 8  # gate and up of all 8 experts (EP off)
        w2 = [lp for lp in params[0] if lp.name.endswith("w2_weight")]
        assert {p.box.sizes[1] for p in w2[0].pieces} == {32 // self.TP}  # down_proj columns per MoE-TP rank
        _check_against_rules(ckpts["moe"][0], params, infos, tp=self.TP)

    def test_refit_equals_fresh_load(self, llm, ckpts):
        a, b, c, hf_b = ckpts["moe"]
        assert greedy(llm, PROMPTS, MAX_TOKENS) != hf_b
        _refit_and_check(llm, b, hf_b)


class TestMoeTP2(_MoeRefit):
    TP = 2


class TestMoeTP1(_MoeRefit):
    TP = 1


class TestDenseTP1:
    """Default CPU mode: every dense linear is repacked, so refits take the reload path."""

    @pytest.fixture(scope="class")
    def llm(self, class_engine, ckpts):
        return class_engine(ckpts["dense"][0], tp=1)

    def test_recording_matches_rules(self, llm, ckpts):
        before = greedy(llm, PROMPTS, MAX_TOKENS)
        infos = llm.collective_rpc("mr_rank_info")
        params = describe(llm)  # records (first call)
        assert greedy(llm, PROMPTS, MAX_TOKENS) == before  # recording left the weights alone
        assert [i["rank"] for i in infos] == [0]
        names = {lp.name for lp in params[0]}
        assert "model.layers.0.self_attn.qkv_proj.weight" in names
        _check_against_rules(ckpts["dense"][0], params, infos, tp=1)

    def test_modes_are_data(self, llm):
        modes = llm.collective_rpc("mr_modes")[0]
        assert modes["model.layers.0.self_attn.qkv_proj.weight"] == "reload"
        assert modes["model.layers.0.input_layernorm.weight"] == "direct"

    def test_refit_equals_fresh_load(self, llm, ckpts):
        a, b, c, hf_b = ckpts["dense"]
        before = greedy(llm, PROMPTS, MAX_TOKENS)
        assert before != hf_b  # A and B really differ
        _refit_and_check(llm, b, hf_b)

    def test_atomic_abort_keeps_old_weights(self, llm, ckpts):
        a, b, c, hf_b = ckpts["dense"]
        _refit_and_check(llm, b, hf_b)
        status = llm.collective_rpc("mr_load_canonical", args=(str(c),),
                                    kwargs={"atomic": True, "stop_after": 40})[0]
        assert status["state"] == "serving"
        after_refit(llm)
        assert greedy(llm, PROMPTS, MAX_TOKENS) == hf_b

    def test_incomplete_refit_is_refused_loudly(self, llm, ckpts):
        a, b, c, hf_b = ckpts["dense"]
        qkv = "model.layers.1.self_attn.qkv_proj.weight"
        # One of three qkv pieces, then finish(): refused naming the parameter, nothing changed.
        with pytest.raises(Exception, match=qkv):
            llm.collective_rpc("mr_load_canonical", args=(str(c),),
                               kwargs={"atomic": True, "only": [qkv], "stop_after": 1, "then": "finish"})
        assert llm.collective_rpc("mr_status")[0]["state"] == "serving"
        after_refit(llm)
        assert greedy(llm, PROMPTS, MAX_TOKENS) == hf_b
        # Streaming mode: an abort after layers were committed must stop serving, loudly.
        status = llm.collective_rpc("mr_load_canonical", args=(str(c),), kwargs={"stop_after": 10})[0]
        assert status["state"] == "not_serving" and "must not serve" in status["reason"]
        # A complete refit brings it back.
        _refit_and_check(llm, b, hf_b)


class TestDenseTP2Direct:
    """Plain-linear CPU mode: kernel format == model format, refits write in place."""

    @pytest.fixture(scope="class")
    def llm(self, class_engine, ckpts):
        return class_engine(ckpts["dense"][0], tp=2, direct=True)

    def test_recording_matches_rules(self, llm, ckpts):
        infos = llm.collective_rpc("mr_rank_info")
        assert sorted(i["rank"] for i in infos) == [0, 1] and {i["tp_size"] for i in infos} == {2}
        _check_against_rules(ckpts["dense"][0], describe(llm), infos, tp=2)

    def test_refit_bit_exact_and_greedy(self, llm, ckpts):
        a, b, c, hf_b = ckpts["dense"]
        modes = llm.collective_rpc("mr_modes")
        assert all(m == "direct" for per in modes for m in per.values()), modes
        _refit_and_check(llm, b, hf_b)
        canon = load_canonical(b)
        for params, sums in zip(describe(llm), llm.collective_rpc("mr_param_checksums")):
            for lp in params:
                want = materialize_local(lp, canon).contiguous()
                assert sums[lp.name] == hashlib.sha256(want.view(torch.uint8).numpy().tobytes()).hexdigest(), lp.name


class TestMoeTP2ExpertParallel:
    """Recording only: the CPU fused-MoE kernel segfaults on an EP forward."""

    @pytest.fixture(scope="class")
    def llm(self, class_engine, ckpts):
        return class_engine(ckpts["moe"][0], tp=2, enable_ep=True)

    def test_recording_matches_rules(self, llm, ckpts):
        infos = llm.collective_rpc("mr_rank_info")
        params = describe(llm)
        for per, info in zip(params, infos):
            w13 = next(lp for lp in per if lp.name.endswith("layers.0.mlp.experts.routed_experts.w13_weight")
                       or lp.name.endswith("layers.0.mlp.experts.w13_weight"))
            experts = {int(p.canonical.split(".experts.")[1].split(".")[0]) for p in w13.pieces}
            assert experts == set(range(4 * info["rank"], 4 * info["rank"] + 4))  # linear placement
        _check_against_rules(ckpts["moe"][0], params, infos, tp=2, enable_ep=True)
