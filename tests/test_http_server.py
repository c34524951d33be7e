"""A running vLLM OpenAI-compatible server as a refit destination, driven by JSON over HTTP
only (``mcore_reshard.refit.servers``): megatron TP2xEP2 ranks refit it, then a refit the engine refuses
(wrong plan digest) must leave it paused at the last committed version, then the controller's
retry (a new refit group) commits; then the trainers' own faults, a flipped bit on the wire and
a streaming refit with a flipped bit, and a killed trainer, are refused the same way, and after
each the server's clients are checked: ``/v1/completions`` waits (the server stays paused);
resumed by hand after an atomic refit failed it serves the last committed weights whole, and
resumed by hand on the weights a failed streaming refit tore, its workers refuse the step. That
server is TP2 (``MCORE_RESHARD_HTTP_TEST_TP=1`` runs it at TP1): with more than one worker,
a failed refit's session must be closed on every worker, the one that raised included, for a
plain controller's retry (``/start_weight_update`` first) to be accepted; and once the trainers
are gone no server process stays busy. A second server, TP1, takes two refits in one group and
ends bit for bit on its own fresh load."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from mcore_reshard.testing.worlds import run_world
from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
from mcore_reshard.errors import RefitFailed
from mcore_reshard.refit.servers import (ServerClient, Timeouts, generate_tokens, prompt_logprobs, refit_servers,
                                         wait_healthy)
from mcore_reshard.infra.ports import free_port
from mcore_reshard.infra.procs import ENV as FAST_START
from mcore_reshard.jobs.serve import server_env
from mcore_reshard.testing.serving import ServerProcess, start_server
from mcore_reshard.refit.verify import token_mult_prob_error

from _http_jobs import http_refit_job, http_two_refits_job, vllm_trainer_api_job
from support.live import assert_idle

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3]
#: Longer than a KV block: its prefix is what a prefix cache keeps.
LONG_PROMPT = [(37 * i + 11) % 900 for i in range(40)]
SERVER_TP = int(os.environ.get("MCORE_RESHARD_HTTP_TEST_TP", "2"))
TIMEOUTS = Timeouts(call_s=60.0, pause_s=120.0, init_s=300.0, update_s=300.0)


@contextlib.contextmanager
def _serving(root: Path, tp: int, seed: int):
    """(base URL, model name, log path, pid): a real server process of TP ``tp`` with the
    backend, on a tiny MoE checkpoint of ``seed``; always killed."""
    ckpt = make_tiny_checkpoint(root / f"tiny-moe-{seed}", moe=True, seed=seed)
    port = free_port()
    log_path = root / f"server-tp{tp}.log"
    argv = [str(ckpt), "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "4", "--seed", "0",
            "--tensor-parallel-size", str(tp)]
    env = server_env()
    if tp > 1:  # one core per worker, shared round-robin when there are fewer cores
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp)))
    proc = start_server(argv, env, log_path)  # the session's fast start: a fork-server child
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, 600.0, alive=lambda: proc.poll() is None)
        except RefitFailed:
            pytest.fail(f"server did not come up:\n{log_path.read_text(errors='replace')[-4000:]}")
        yield url, str(ckpt), log_path, proc.pid
    finally:
        _stop(proc)


@pytest.fixture
def server(tmp_path: Path):
    with _serving(tmp_path, SERVER_TP, seed=5) as s:
        yield s


@pytest.fixture(scope="module")
def tp1_server(tmp_path_factory):
    """A TP1 server on the tiny MoE checkpoint of seed 6, shared by the tests below in file
    order: the first reads its fresh answers before any refit."""
    with _serving(tmp_path_factory.mktemp("tp1"), 1, seed=6) as s:
        yield s


def _stop(proc: ServerProcess | subprocess.Popen) -> None:
    """SIGTERM the server's process group (the API server and its engine core), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def _trainers(job, model: str, server_tp: int, q, out: dict, **kw) -> threading.Thread:
    """Megatron TP2xEP2 ranks running ``job`` on a thread (they hand the controller its JSON
    through ``q``); their results, or the error, land in ``out``."""
    def run() -> None:
        try:
            out["ranks"] = run_world(job, 2, (model, "float32", MegatronParallel(tp=2, ep=2, etp=1),
                                              VllmParallel(tp=server_tp), TOKENS, q), timeout_s=900, **kw)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t


def _completion_hangs(url: str, model: str, wait_s: float = 2.0) -> bool:
    """True when a completion gets no reply within ``wait_s`` (a paused server holds it; one
    that serves answered this prompt in 0.06-0.11 s here, and a late reply can only make the
    check pass where it should fail, never the reverse)."""
    t0 = time.monotonic()
    try:
        prompt_logprobs(url, model, TOKENS, timeout_s=wait_s)
    except RefitFailed as exc:
        return f"no reply within {wait_s:g}s" in str(exc) and time.monotonic() - t0 >= wait_s
    return False


def test_http_server_refit_then_refused_refit_keeps_it_paused(server):
    import torch.multiprocessing as mp

    url, model, log_path, server_pid = server
    # under the session's fast start the server is a child of this process's fork server, not
    # a new interpreter (testing/serving.py); with MCORE_RESHARD_FAST_START=0 it is this one's
    parent = psutil.Process(server_pid).parent()
    if os.environ.get(FAST_START) == "1":
        assert "forkserver" in " ".join(parent.cmdline())
    else:
        assert parent.pid == os.getpid()
    api = ServerClient(url, TIMEOUTS)
    assert api.weight_version() == "default"
    before = prompt_logprobs(url, model, TOKENS)

    q = mp.get_context("spawn").Queue()
    out: dict = {}
    t = _trainers(http_refit_job, model, SERVER_TP, q, out, may_exit=(1,))
    try:
        # 1. A refit through HTTP only, concurrently with the trainers' side.
        msg = q.get(timeout=600)
        init_info = msg["init_info"]
        assert "slices" not in init_info and len(json.dumps(init_info)) < 2048  # slices travel by digest
        refit_servers([url], msg["update_info"], "refit-1", init_info=init_info, timeouts=TIMEOUTS)
        assert api.weight_version() == "refit-1" and not api.is_paused()
        served_1 = prompt_logprobs(url, model, TOKENS)

        # 2. The trainers train again and refit; the controller names a plan no worker holds.
        msg = q.get(timeout=600)
        bad = dict(msg["update_info"]["request"], plan_digest="f" * 64)
        t1 = time.monotonic()
        with pytest.raises(RefitFailed) as failed:
            refit_servers([url], {"request": bad}, "refit-2", timeouts=TIMEOUTS)
        print(f"refused refit over HTTP: {time.monotonic() - t1:.1f}s: {failed.value}")
        refused_state = (api.weight_version(), api.is_paused())
        refused_hangs = _completion_hangs(url, model)
        api.resume()  # by hand, only to look: what a controller does after a good refit
        refused_served = prompt_logprobs(url, model, TOKENS)

        # 3. The controller's retry: a new refit group, the trained weights committed and served.
        msg = q.get(timeout=600)
        refit_servers([url], msg["update_info"], "refit-3", init_info=msg["init_info"], timeouts=TIMEOUTS)
        assert api.weight_version() == "refit-3" and not api.is_paused()
        served_3 = prompt_logprobs(url, model, TOKENS)

        # 4. The trainers train again; one flips a bit on the wire: refused over HTTP.
        msg = q.get(timeout=600)
        with pytest.raises(RefitFailed) as flipped:
            refit_servers([url], msg["update_info"], "refit-4", timeouts=TIMEOUTS)
        flip_state, flip_hangs = (api.weight_version(), api.is_paused()), _completion_hangs(url, model)
        api.resume()
        flip_served = prompt_logprobs(url, model, TOKENS)

        # 5. The same flipped bit in a streaming refit (atomic=false; a new group, as after
        # every failure): layers went live as they completed, so the workers hold a mix.
        # Left paused (not resumed). Driven by a plain controller, call by call, right after
        # refit 4's failed /finish_weight_update: its /start_weight_update is accepted (vLLM
        # once left the raising worker's session open: "already active", and a controller
        # that stopped at that 500 never recovered).
        msg = q.get(timeout=600)
        api.pause("wait")
        api.init_weight_transfer(msg["init_info"])
        api.start_weight_update()
        api.update_weights(msg["update_info"])
        with pytest.raises(RefitFailed) as torn:
            api.finish_weight_update("refit-5")
        print(f"streaming refit refused: {torn.value}")
        torn_state, torn_hangs = (api.weight_version(), api.is_paused()), _completion_hangs(url, model)

        # 6. A trainer is killed after its last byte, before its vote (a new group).
        msg = q.get(timeout=600)
        t6 = time.monotonic()
        with pytest.raises(RefitFailed) as killed:
            refit_servers([url], msg["update_info"], "refit-6", init_info=msg["init_info"], timeouts=TIMEOUTS)
        kill_s = time.monotonic() - t6
        kill_state, kill_hangs = (api.weight_version(), api.is_paused()), _completion_hangs(url, model)
        t.join(timeout=900)
        # the trainers are gone (one killed, the other left): no server process stays busy
        server_procs = [server_pid] + [c.pid for c in psutil.Process(server_pid).children(recursive=True)]
        assert_idle(server_procs)
        # Resumed by hand, bypassing the gate: the torn model (refit 5; refit 6 did not heal
        # it) must refuse to compute, in the workers themselves.
        api.resume()
        with pytest.raises(RefitFailed) as bypass:
            prompt_logprobs(url, model, TOKENS, timeout_s=120.0)
    finally:
        if t.is_alive():
            t.join(timeout=60)
    assert "error" not in out, out.get("error")
    ranks = out["ranks"]
    assert ranks[1] is None  # the killed trainer
    line = str(failed.value)
    # ``/update_weights`` votes; the refit's outcome (here: aborted) is ``/finish_weight_update``'s
    assert "\n" not in line and line.startswith(f"{url} POST /finish_weight_update: HTTP 500")
    assert "asked to run plan ffffffffffffffff" in line and "kept paused" in line, line
    # every worker refuses the digest; the decision names the ones whose "no" it had read first
    assert re.search(r"vLLM destination rank [0-9]+: RefitError", line), line
    # the failed session was closed (the expected refusals of that ignored): one error, one route
    assert line.count("/finish_weight_update") == 1 and "/update_weights" not in line, line
    assert "aborted" in ranks[0]["second_error"] or "not committed" in ranks[0]["second_error"], ranks[0]

    # The served weights after refit 1 are the trainers' (fp32: equal up to kernel order).
    assert token_mult_prob_error(served_1, ranks[0]["logprobs_1"]) < 1.001
    assert token_mult_prob_error(before, ranks[0]["logprobs_1"]) > 1.01

    # After the refused refit: the last committed version, and the server stays paused, so a
    # completion does not complete (it waits for /resume; the client gave up after 2 s).
    assert refused_state == ("refit-1", True)
    assert refused_hangs
    # Resumed by hand, it served refit 1's weights, whole: the aborted refit changed nothing,
    # and the newly trained weights never reached the server.
    assert token_mult_prob_error(refused_served, ranks[0]["logprobs_1"]) < 1.001
    assert token_mult_prob_error(refused_served, ranks[0]["logprobs_2"]) > 1.001
    # The retry committed them.
    assert token_mult_prob_error(served_3, ranks[0]["logprobs_2"]) < 1.001

    # A flipped bit: every destination checksum is checked before the vote; the server says
    # which rank saw what, keeps refit 3's version, stays paused, and serves refit 3 whole.
    print(f"flipped bit over HTTP: {flipped.value}\nstreaming, flipped bit: {torn.value}\n"
          f"killed trainer over HTTP ({kill_s:.1f}s): {killed.value}")
    for exc in (flipped.value, torn.value, killed.value):
        msg_line = str(exc)
        assert "\n" not in msg_line and msg_line.startswith(f"{url} POST /finish_weight_update: HTTP 500"), msg_line
        assert re.search(r"rank [0-9]+", msg_line), msg_line
        assert exc is torn.value or "kept paused" in msg_line, msg_line  # refit_servers' note
    assert "checksum" in str(flipped.value) and "checksum" in ranks[0]["flip_error"], (flipped.value, ranks[0])
    assert flip_state == ("refit-3", True) and flip_hangs
    assert token_mult_prob_error(flip_served, ranks[0]["logprobs_2"]) < 1.001
    assert token_mult_prob_error(flip_served, ranks[0]["logprobs_3"]) > 1.001
    # A streaming refit that failed: the same over HTTP; the server stays paused.
    assert "checksum" in str(torn.value) and "checksum" in ranks[0]["torn_error"], (torn.value, ranks[0])
    assert torn_state == ("refit-3", True) and torn_hangs
    # A killed trainer: the decision names it (rank 0 learns of its death at once), the same.
    assert re.search(r"source rank 1 \(group rank 1\) died", str(killed.value)), killed.value
    assert "source rank 1 (group rank 1) died" in ranks[0]["kill_error"], ranks[0]
    assert kill_state == ("refit-3", True) and kill_hangs
    # Resumed by hand on torn weights: no completion is computed; a worker refused the step.
    log = log_path.read_text(errors="replace")
    print(f"resumed by hand on torn weights: {bypass.value}")
    assert re.search(r"model step refused: refit .*(already torn|partly replaced|already committed)", log), log[-3000:]
    print(f"init info: {len(json.dumps(init_info))} B by digest vs {ranks[0]['init_info_bytes_inline']} B of slices inline;"
          f" server log {log_path}; trainers' refused refit: {ranks[0]['second_s']:.1f}s: {ranks[0]['second_error']}")


def test_http_server_tp1_two_refits_equal_the_trainers_then_its_own_fresh_load(tp1_server):
    """A TP1 server, refit twice over HTTP only in one refit group: the trainers' weights after
    a training step (every rank verified, bytes at the minimum, served logprobs within the fp32
    bound of megatron's), then the server's own checkpoint refit back, overlapped (received in
    the background, swapped at ``/finish_weight_update``): its logprobs then equal exactly those
    it served at start (vLLM's own load of that checkpoint, a fresh engine). Both carry the
    canary (``refit.canary``), which the server's worker runs and passes. While that refit is
    in flight (``/update_weights`` returned, the swap not yet made) the server is not paused and
    serves the trained weights, exactly.

    Caches keyed by weight version: a prompt whose KV was cached under the first refit's weights
    decodes, after the second, exactly what the fresh engine decoded (tokens and log-probs).

    Outputs that say their weights: a greedy request through vLLM's token-in/token-out route
    (``generate_tokens``) runs across that swap: frozen after 8 of its 192 tokens by a ``keep``
    pause, as the swap's own pause would, so the swap lands inside it whatever the machine's
    speed (a request a loaded machine finished before the pause is sent again). Its
    result names "refit-1" for the tokens before the swap and "refit-2" after it, and the tokens
    of each span are what those weights decode (the second span teacher-forced: the running
    request's KV is recomputed on the new weights)."""
    import torch.multiprocessing as mp

    url, model, _log, _pid = tp1_server
    api = ServerClient(url, TIMEOUTS)
    fresh = prompt_logprobs(url, model, TOKENS)
    prompt, n = LONG_PROMPT, 192  # long: the pause lands while it decodes, whatever the load
    first = generate_tokens(url, prompt, n)  # the fresh engine's greedy decode (and its KV cached)
    q = mp.get_context("spawn").Queue()
    out: dict = {}
    t = _trainers(http_two_refits_job, model, 1, q, out)
    try:
        msg = q.get(timeout=600)
        refit_servers([url], msg["update_info"], "refit-1", init_info=msg["init_info"], timeouts=TIMEOUTS)
        assert api.weight_version() == "refit-1" and not api.is_paused()
        trained = prompt_logprobs(url, model, TOKENS)
        old = generate_tokens(url, prompt, n)  # its prompt's KV now cached under refit-1's weights
        assert old.weight_versions == (("refit-1", 0, n),) and len(old.token_ids) == n
        msg = q.get(timeout=600)
        during: list = []
        spanning: dict = {}
        running: list = []

        def spanning_request(frozen: threading.Event) -> None:
            try:
                spanning["out"] = generate_tokens(url, prompt, n, timeout_s=600.0,
                                                  on_tokens=lambda k: k >= 8 and frozen.set())
            except BaseException as exc:  # noqa: BLE001 - asserted below
                spanning["error"] = exc

        def serve_meanwhile() -> None:  # the refit is in flight: the old weights, no pause
            during.append((api.is_paused(), api.weight_version(), prompt_logprobs(url, model, TOKENS)))
            for _ in range(5):  # a request frozen mid-way (a loaded machine may finish one first: again)
                frozen = threading.Event()
                t_req = threading.Thread(target=spanning_request, args=(frozen,))
                t_req.start()
                assert frozen.wait(120)
                api.pause("keep")  # the swap pauses (keep) again, then resumes
                t_req.join(timeout=1.0)  # a finished request's stream ends at once; a frozen one stays open
                if t_req.is_alive():
                    running.append(t_req)
                    return
                api.resume()
            raise AssertionError("five requests of 192 tokens each finished before a pause could freeze them")

        notes = refit_servers([url], msg["update_info"], "refit-2", timeouts=TIMEOUTS,  # same group
                              before_swap=serve_meanwhile, recompute_kv_cache_after_weight_updates=True)
        assert api.weight_version() == "refit-2" and not api.is_paused() and notes == []
        assert during == [(False, "refit-1", trained)]
        running[0].join(timeout=600)  # (alone from here: a batch of other shapes computes other last bits)
        assert "error" not in spanning, spanning.get("error")
        back = prompt_logprobs(url, model, TOKENS)
        again = generate_tokens(url, prompt, n)  # the prompt cached under refit-1, decoded on refit-2
        across = spanning["out"]
        k = across.weight_versions[1][1] if len(across.weight_versions) == 2 else -1
        forced = generate_tokens(url, prompt + list(across.token_ids[:k]), n - k) if k > 0 else None
    finally:
        t.join(timeout=900)
    assert "error" not in out, out.get("error")
    rank0 = out["ranks"][0]
    # the engine's one worker received the minimum, then (the second refit a delta back to the
    # checkpoint) at most that: the elements the training step changed
    assert rank0["full"] == [rank0["bytes_min"]] * 2 and rank0["delta"] == [False, True]
    assert rank0["received"][0] == rank0["bytes_min"] >= rank0["received"][1] > 0
    assert rank0["verified"] == [rank0["ranks"]] * 2  # every rank of both sides, both refits
    # the canary over HTTP: the blocking refit's worker ran it before its vote; the overlapped
    # one's runs at the swap, inside /finish_weight_update, after the report (and passed: served)
    assert rank0["canary"][0] == [True]
    assert token_mult_prob_error(trained, rank0["logprobs_1"]) < 1.001
    assert token_mult_prob_error(trained, fresh) > 1.01  # the training step reached the server
    assert back == fresh, max(abs(a - b) for a, b in zip(back, fresh))  # fp32, TP1: bit for bit
    # no request reuses KV cached under older weights: the prompt cached under refit-1 decodes,
    # on refit-2's weights (the checkpoint), exactly what the fresh engine decoded
    assert (again.token_ids, again.logprobs) == (first.token_ids, first.logprobs) and len(first.logprobs) == n
    assert again.weight_versions == (("refit-2", 0, n),) and old.logprobs != first.logprobs
    # the request that ran across the swap: both versions, the token where they change
    assert across.weight_versions == (("refit-1", 0, k), ("refit-2", k, n)) and 8 <= k < n, across.weight_versions
    assert across.token_ids[:k] == old.token_ids[:k]  # the trained weights' greedy tokens
    assert across.token_ids[k:] == forced.token_ids and forced.weight_versions == (("refit-2", 0, n - k),)


def test_trainers_refit_a_server_through_vllms_own_trainer_api_only(tp1_server):
    """A framework written against vLLM's trainer-side API: each megatron rank (TP2xEP2) builds
    ``WeightTransferTrainerFactory.trainer_init(ReshardTrainerInitInfo(...), client=
    HTTPVLLMWeightSyncClient(url), source=TrainerShards(...))`` and calls ``send_weights()``
    after each of two training steps -- no driver, no controller, no project call on the
    server. A layout stated wrongly (bf16 for an fp32 engine) is refused by the engine's own
    slice check at the first refit, on every rank, in one line. A connection that drops on rank
    0's ``update_weights`` fails that refit on every rank at once, and the next ``send_weights``
    builds a new refit group and commits. Each committed refit moves the
    minimum, every rank of both sides verifies it, the server's version is the refit's
    identity, and it serves what megatron computes within fp32's bound (and not what it served
    before the step)."""
    url, model, _log, _pid = tp1_server
    api = ServerClient(url, TIMEOUTS)
    before = prompt_logprobs(url, model, TOKENS)
    ranks = run_world(vllm_trainer_api_job, 2, (model, "float32", MegatronParallel(tp=2, ep=2, etp=1),
                                                VllmParallel(tp=1), TOKENS, url), timeout_s=900)
    rank0 = ranks[0]
    for r in ranks:  # the wrongly stated layout: refused by the engine's own check, on every rank, in seconds
        line, seconds = r["refused"]
        assert "\n" not in line and seconds < 30.0, r["refused"]
        print(f"trainer rank: a wrongly stated layout refused in {seconds:.1f}s: {line}")
        assert re.search(r"vLLM destination rank 0: .* carries '.+' as bfloat16, this worker holds it in float32",
                         line), line
    for r in ranks:  # a dropped connection on rank 0's update_weights: every rank fails at once, naming it
        line, seconds = r["dropped"]
        print(f"trainer rank: a dropped update_weights failed the refit in {seconds:.1f}s: {line[:300]}")
        assert "\n" not in line and seconds < 30.0 and "injected: the connection to the server dropped" in line, line
    # after either failed refit the server serves exactly what it served before (fp32, TP1: bit for bit)
    assert rank0["after_refused"] == before and rank0["after_dropped"] == before
    assert ranks[1]["reports"] == rank0["reports"]  # every rank read the same vote
    received, full, delta = [], [], []
    for step, (trainer, served) in enumerate(zip(rank0["trainer"], rank0["served"])):
        assert token_mult_prob_error(served, trainer) < 1.001, step
        dst = [r for r in rank0["reports"][step] if r[0] == "dst"]
        assert len(rank0["reports"][step]) == 3 and all(r[2] for r in rank0["reports"][step]), rank0["reports"]
        received.append(sum(r[3] for r in dst))
        full.append(sum(r[4] for r in dst))
        delta.append(all(r[5] for r in dst))
    # the minimum, then (delta refits on by default) at most it: what the second step changed
    assert full == [rank0["bytes_min"]] * 2 and delta == [False, True]
    assert received[0] == rank0["bytes_min"] >= received[1] > 0
    assert token_mult_prob_error(rank0["served"][0], before) > 1.01  # the first step reached the server
    assert token_mult_prob_error(rank0["served"][1], rank0["served"][0]) > 1.001  # and so did the second
    assert api.weight_version() == rank0["refit"]  # labelled with the refit's identity: it never repeats
    assert not api.is_paused()
