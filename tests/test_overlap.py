"""Refit while generating (``refit.overlap``): each vLLM worker receives into shadow weights
on a thread of its own while the engine keeps running model steps on the live weights; after
every rank voted the driver pauses the engine only to swap (``finish_weight_update``).

A trainer stalls before its vote, so the refit is still in flight while this thread
generates (a tiny model's bytes would otherwise arrive before the first token): what the
engine serves meanwhile must equal, token for token and logprob for logprob, what it served
before the refit started; after the swap, the trainers' weights (``verify=full`` on every
rank). A refit that fails in the background (a flipped bit, a killed trainer) leaves the
engine on exactly the old weights through ``generate`` and ``enqueue``, and the next refit
restores. Same engine and trainer pool as ``test_faults`` (bf16 tiny MoE, TP2xEP2 -> TP2).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import greedy, prompt_logprobs, worker_status
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.errors import ConfigError, RefitFailed
from mcore_reshard.faults import Faults, TrainerFault
from mcore_reshard.layout import load_model_spec
from mcore_reshard.protocol import VerifyMode
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.transport.executor import Fault
from support.live import cluster as shared_cluster

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]
PROMPTS = [TOKENS[:6], TOKENS[6:12]]
BF16_BOUND = 1.02  # token_mult_prob_error, vLLM vs megatron's forward
#: The trainer's stall before its vote: the refit is in flight this long while we generate.
STALL = Fault("sleep", at="before_vote", seconds=4.0)


@pytest.fixture(scope="module")
def cluster(ckpt_cache, engine_cache):
    ckpt = ckpt_cache.get(moe=True, dtype="bfloat16", seed=13)
    spec = load_model_spec(ckpt, dtype="bfloat16")
    llm = engine_cache.get(ckpt, tp=2, dtype="bfloat16")
    refit = RefitConfig(buffer_bytes=1 << 16, timeout_s=10.0, verify=VerifyMode.FULL, overlap=True)
    with shared_cluster(spec, ckpt, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2), refit,
                        train={"lr": 0.05}, engines=[llm]) as c:
        yield c
    engine_cache.check(llm)


def _served(llm) -> tuple[list[float], list[list[int]]]:
    """What the engine serves now: the prompt's logprobs and greedy completions."""
    return prompt_logprobs(llm, TOKENS), greedy(llm, PROMPTS, 8)


def _armed(cluster) -> tuple[list[float], list[list[int]]]:
    """Engine and trainers in step, then one optimizer step: the trainers hold new weights,
    the engine the old ones. Returns what the engine serves (old weights)."""
    m, _ = cluster.refit_while(lambda: None)
    assert m.verified and m.overlapped
    old = _served(cluster.engines[0])
    cluster.step(TOKENS)
    return old


def test_the_engine_serves_the_old_weights_while_receiving_then_swaps_in_the_new(cluster):
    llm = cluster.engines[0]
    old = _armed(cluster)

    def during():
        # The refit is in flight (a trainer stalls before its vote): every worker has
        # received into its shadows, nobody has committed, the engine keeps decoding.
        statuses = worker_status(llm)
        return _served(llm), statuses

    m, (meanwhile, statuses) = cluster.refit_while(during, faults=Faults(TrainerFault(0, STALL)))
    assert meanwhile == old  # token for token, logprob for logprob: the live weights untouched
    assert all(s.state == "serving" for s in statuses), statuses
    assert m.verified and m.overlapped and m.bytes_moved == m.bytes_min
    assert any("full verification" in n for n in m.notes), m.notes  # every rank equals the trainers'
    assert m.pause_seconds > 0.0 and m.peak_extra_bytes > 0  # shadows are counted
    after = _served(llm)
    assert after[0] != old[0]
    assert cluster.logprob_error(TOKENS) < BF16_BOUND
    versions = {s.version for s in worker_status(llm)}
    assert len(versions) == 1 and versions != {statuses[0].version}  # both workers swapped, one version
    print(f"overlapped refit: {m.seconds:.3f}s moving, engine paused {m.pause_seconds * 1e3:.1f} ms for the swap")


@pytest.mark.parametrize("fault", [Fault("bitflip", bucket=1), Fault("exit", at="before_vote", seconds=2.0)],
                         ids=["bitflip", "killed-trainer"])
def test_a_refit_failing_in_the_background_leaves_the_old_weights_and_the_next_restores(cluster, fault):
    llm = cluster.engines[0]
    old = _armed(cluster)
    rank = 0 if fault.kind == "bitflip" else 1
    with pytest.raises(RefitFailed) as err:
        cluster.refit_while(lambda: _served(llm), faults=Faults(TrainerFault(rank, fault)))
    msg = str(err.value)
    assert ("checksum" in msg) if fault.kind == "bitflip" else ("training rank 1 died" in msg), msg
    assert _served(llm) == old  # generate: exactly the old weights, on every worker
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy_params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == old[1]
    rid = "after-failed-overlap"
    llm.llm_engine.add_request(rid, {"prompt_token_ids": PROMPTS[0]}, _greedy_params())  # enqueue path
    done = []
    while llm.llm_engine.has_unfinished_requests():
        done += [o for o in llm.llm_engine.step() if o.finished]
    assert [list(o.outputs[0].token_ids) for o in done if o.request_id == rid] == [old[1][0]]
    if fault.kind == "exit":
        cluster.restart_trainers()
    m, _ = cluster.refit_while(lambda: None)
    assert m.verified and m.bytes_moved == m.bytes_min
    assert cluster.logprob_error(TOKENS) < BF16_BOUND


def test_a_shadow_cap_below_a_workers_share_is_refused_before_a_byte_moves(cluster):
    d = cluster.driver
    cfg = d.refit_config
    d.refit_config = replace(cfg, max_shadow_bytes=1024)
    try:
        with pytest.raises(ConfigError) as err:
            d.begin_refit()
    finally:
        d.refit_config = cfg
    msg = str(err.value)
    assert "refit.max_shadow_bytes=1024" in msg and "destination rank" in msg and "\n" not in msg, msg
    m, _ = cluster.refit_while(lambda: None)  # nothing was started: the next refit runs as usual
    assert m.verified and m.bytes_moved == m.bytes_min


def _greedy_params():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
