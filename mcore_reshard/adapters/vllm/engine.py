"""Start, query and stop a vLLM engine wired with the reshard worker extension.

What a driver knows of an engine before it plans is :class:`EngineInfo` (:func:`engine_info`):
an engine started with only ``weight_transfer_config={"backend": "mcore_reshard"}`` is described
by the rules (``rules.vllm_layout``), one with the diagnostics extension by what its workers
record (:func:`describe`); the diagnostics replies arrive as the typed messages of
``protocol.py``.

Scripts that call :func:`start_engine` need an ``if __name__ == "__main__":`` guard
(vLLM spawns worker processes).
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from ...errors import EngineUnresponsive, RefitIncomplete
from ...infra.vlm import is_vlm_checkpoint
from ...layout.descriptor import LocalParam
from ...transport.destination import mark_stuck, stuck
from ...transport.views import ReceivedWeights
from ...wire.protocol import WorkerLayout, WorkerStatus
from .fp8 import engine_quantization
from .rules import VllmParallel
from .worker import PLAIN_LINEAR_ENV, ReshardWorkerExtension
from .worker import REFIT_EXTENSION as EXTENSION

__all__ = ["EXTENSION", "EngineInfo", "engine_info", "start_engine", "stop_engine", "greedy", "prompt_logprobs",
           "after_refit", "reset_encoder_cache", "is_multimodal", "describe", "worker_status", "received_weights",
           "raw_bandwidth", "check_serving",
           "AsyncEngine", "start_async_engine", "engine_call", "unanswered", "left_waiting", "STATUS_DEADLINE_S",
           "HELPER_DEADLINE_S"]

T = TypeVar("T")

#: Seconds a status read (``is_sleeping``, ``mr_status``) may take: an answer needs no model step.
STATUS_DEADLINE_S = 10.0
#: Seconds a helper's ``generate`` may take (tiny models on CPU answer in well under one).
HELPER_DEADLINE_S = 120.0


#: Why no call may be sent to an engine now (a call left running past its deadline), and
#: recording one: the refit's own bookkeeping (``transport.destination``), shared with it.
unanswered, left_waiting = stuck, mark_stuck


def engine_call(llm: Any, what: str, fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()`` (one call on ``llm``) with a deadline. Past it, raises ``EngineUnresponsive``
    naming the call, and leaves the call running on its daemon thread: until it returns, every
    ``engine_call`` on ``llm`` is refused at once (``unanswered``), so no later call's reply is
    ever taken for this one's."""
    busy = unanswered(llm)
    if busy is not None:
        raise EngineUnresponsive(f"engine refused {what}: {busy}")
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            box["error"] = exc

    since = time.monotonic()
    t = threading.Thread(target=run, daemon=True, name=f"engine-call-{what}")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        left_waiting(llm, t, what, since)
        raise EngineUnresponsive(f"the engine did not answer {what} within {timeout_s:.0f}s (a worker stopped, "
                                 f"hung or dead); no call is sent to it until that one returns")
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass(frozen=True)
class EngineInfo:
    """One engine as a driver plans for it: its workers (tp * pp * dp), the dtype it serves,
    its parallel sizes (the rules' layout of a plain engine) and its worker extension's
    qualified class name ("" for a plain engine)."""

    world_size: int
    dtype: str
    parallel: VllmParallel
    worker_extension: str = ""
    #: It runs a speculative-decoding draft model (``speculative_config`` with a draft model):
    #: its refits move the draft with the target.
    draft: bool = False

    @property
    def diagnostics(self) -> bool:
        """Whether its workers answer the diagnostics calls (``ReshardWorkerExtension`` or a
        subclass, e.g. the HF baseline's)."""
        mod, _, name = self.worker_extension.rpartition(".")
        if not mod:
            return False
        try:
            cls = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            return False
        return isinstance(cls, type) and issubclass(cls, ReshardWorkerExtension)


def engine_info(llm: Any) -> EngineInfo:
    """What ``llm`` is: read from its vLLM config (``LLM``), or as a handle states it up front
    (``engine_info``: an engine in another process, e.g. a Ray actor's)."""
    stated = getattr(llm, "__dict__", {}).get("engine_info")
    if stated is not None:
        return stated
    return info_of_config(llm.llm_engine.vllm_config)


def info_of_config(vllm_config: Any) -> EngineInfo:
    par = vllm_config.parallel_config
    dp = int(getattr(par, "data_parallel_size", 1) or 1)
    eplb = getattr(par, "eplb_config", None)
    parallel = VllmParallel(tp=int(par.tensor_parallel_size), pp=int(par.pipeline_parallel_size), dp=dp,
                            enable_ep=bool(par.enable_expert_parallel),
                            num_redundant_experts=int(getattr(eplb, "num_redundant_experts", 0) or 0),
                            expert_placement=str(getattr(par, "expert_placement_strategy", "linear") or "linear"),
                            quantization=engine_quantization(vllm_config))
    spec = getattr(vllm_config, "speculative_config", None)
    return EngineInfo(int(par.world_size) * dp, str(vllm_config.model_config.dtype).replace("torch.", ""), parallel,
                      str(getattr(par, "worker_extension_cls", "") or ""),
                      draft=spec is not None and getattr(spec, "draft_model_config", None) is not None)

def start_engine(model_dir: str, tp: int = 1, dtype: str = "float32", enable_ep: bool = False,
                 direct: bool = False, **kw: Any):
    """An ``LLM`` on ``model_dir`` with the worker extension and small CPU-friendly defaults.

    ``direct=True`` keeps CPU dense linears in model format (plain ``F.linear``) so
    refits write them in place; the default keeps vLLM's repacked kernels.
    """
    from vllm import LLM

    return LLM(**_engine_args(model_dir, tp, dtype, enable_ep, direct, kw))


def _engine_args(model_dir: str, tp: int, dtype: str, enable_ep: bool, direct: bool, kw: dict) -> dict[str, Any]:
    """Engine settings (and the CPU environment) shared by ``LLM`` and ``AsyncLLM``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = os.cpu_count() or tp
        per = cores // tp
        # One core range per worker; with more workers than cores (TP4 on 2 cores) they share
        # cores round-robin instead of naming cores that do not exist.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{r % cores}" if per <= 1 else f"{r * per}-{r * per + per - 1}" for r in range(tp))
    os.environ[PLAIN_LINEAR_ENV] = "1" if direct else "0"
    args: dict[str, Any] = dict(
        model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
        max_model_len=256, max_num_seqs=4, seed=0, tensor_parallel_size=tp,
        enable_expert_parallel=enable_ep, worker_extension_cls=EXTENSION,
    )
    mla = _cpu_mla_args(model_dir)
    args.update(mla)
    if is_vlm_checkpoint(model_dir):  # vLLM's multimodal processor needs the tokenizer; one image per prompt
        args.update(skip_tokenizer_init=False, limit_mm_per_prompt={"image": 1})
    args.update(kw)
    draft = args.get("speculative_config")
    if mla and isinstance(draft, dict) and "attention_backend" not in draft:
        # the MTP draft's MLA layers choose their backend on their own: AMX_MLA on a CPU with AMX
        args["speculative_config"] = dict(draft, attention_backend=mla["attention_backend"])
    return args


class AsyncEngine:
    """vLLM's ``AsyncLLM`` on its own event-loop thread, with the blocking weight-transfer
    calls a driver makes (the same names as ``LLM``'s), while clients submit ``generate``
    coroutines to ``loop`` (``submit``) and keep generating during a refit's calls.

    ``engine_info`` (and ``world_size``, ``dtype``) are stated up front, as for any remote engine handle.

    Prefix caching across refits: a request this wrapper submits carries ``cache_salt`` = the
    weight version the engine serves when it arrives (set by the driver's
    ``update_weight_version``) and how many times it was set, so no new request reuses KV
    blocks cached under older weights, even when requests still running kept vLLM from
    resetting its prefix cache after the swap (``recompute_kv_cache_after_weight_updates=false``)
    and even when a new driver repeats an earlier version's label. A prompt with its own salt
    keeps it.
    """

    def __init__(self, engine: Any, loop: Any, thread: Any) -> None:
        self.engine, self.loop, self._thread = engine, loop, thread
        self.engine_info = info_of_config(engine.vllm_config)
        self.world_size, self.dtype = self.engine_info.world_size, self.engine_info.dtype
        self.weight_version: str | None = None  # the last version the driver set (None: as loaded)
        self._swaps = 0  # versions set so far: labels may repeat, swaps do not

    def update_weight_version(self, version: str) -> None:
        self._call("update_weight_version", version)
        self.weight_version = version
        self._swaps += 1

    def submit(self, coro: Any) -> Any:
        """Run a coroutine on the engine's loop; returns a ``concurrent.futures.Future``."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.submit(getattr(self.engine, name)(*args, **kwargs)).result()

    def init_weight_transfer_engine(self, request: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._call("init_weight_transfer_engine", WeightTransferInitRequest(init_info=request["init_info"]))

    def update_weights(self, request: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._call("update_weights", WeightTransferUpdateRequest(update_info=request["update_info"]))

    def generate(self, prompts: Sequence[Any], sampling_params: Any, use_tqdm: bool = False,
                 lora_request: Any = None) -> list[Any]:
        """``LLM.generate``'s shape: every prompt as one request on the engine's loop, all at
        once; their final outputs in prompt order (so the helpers below serve both engines)."""
        import asyncio
        import uuid
        from copy import copy

        from vllm.sampling_params import RequestOutputKind

        sp = copy(sampling_params)
        sp.output_kind = RequestOutputKind.FINAL_ONLY  # n > 1: one output with all n completions

        salt = None if self.weight_version is None else f"weights:{self.weight_version}#{self._swaps}"

        async def one(prompt: Any) -> Any:
            if salt is not None and isinstance(prompt, dict) and "cache_salt" not in prompt:
                prompt = {**prompt, "cache_salt": salt}
            final = None
            async for out in self.engine.generate(prompt, sp, request_id=uuid.uuid4().hex, lora_request=lora_request):
                final = out
            return final

        async def every() -> list[Any]:
            return list(await asyncio.gather(*(one(p) for p in prompts)))

        return self.submit(every()).result()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._call(name, *args, **kwargs)

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.engine.shutdown)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


def start_async_engine(model_dir: str, tp: int = 1, dtype: str = "float32", enable_ep: bool = False,
                       direct: bool = False, **kw: Any) -> AsyncEngine:
    """An ``AsyncLLM`` on ``model_dir`` with the same settings as :func:`start_engine`."""
    import asyncio
    import threading

    llm_args = _engine_args(model_dir, tp, dtype, enable_ep, direct, kw)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            ready["engine"] = AsyncLLM.from_engine_args(AsyncEngineArgs(**llm_args))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            ready["error"] = exc
            return
        finally:
            ready["done"] = True
        loop.run_forever()

    thread = threading.Thread(target=run, name="async-llm-loop", daemon=True)
    thread.start()
    while "done" not in ready:
        thread.join(0.1)
    if "error" in ready:
        raise ready["error"]
    return AsyncEngine(ready["engine"], loop, thread)


def _cpu_mla_args(model_dir: str) -> dict[str, Any]:
    """Engine settings an MLA model (DeepSeek-V3 family) needs on vLLM's CPU build.

    - ``attention_backend="CPU_MLA"``: on a CPU with AMX vLLM picks AMX_MLA, which takes only
      bf16 weights (an fp32 engine fails to load: "expect weight to be bfloat16, ...").
    - the PyTorch rotary embedding instead of the C++ ``rotary_embedding`` op: MLA hands it a
      strided 3-D ``q[..., nope:]`` and a ``k_pe`` view into each latent row, while the CPU op
      assumes a contiguous 2-D [tokens, heads * head_size] layout and rotates the wrong rows
      (only position 0 comes out right; vLLM then drifts from HF by up to 0.025 nats in fp32).
      With the PyTorch rotary it matches HF to 5e-7.
    """
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if cfg.get("kv_lora_rank") is None:
        return {}
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"attention_backend": "CPU_MLA", "compilation_config": {"custom_ops": ["-rotary_embedding"]}}


def stop_engine(llm: Any) -> None:
    """Shut the engine core (and its workers) down now, not at interpreter exit."""
    if isinstance(llm, AsyncEngine):
        llm.shutdown()
        return
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()


def describe(llm: Any, timeout_s: float = 300.0) -> list[list[LocalParam]]:
    """Per worker (in rank order of ``collective_rpc``) its recorded ``LocalParam`` list
    (diagnostics extension)."""
    wire = engine_call(llm, "mr_describe", lambda: llm.collective_rpc("mr_describe"), timeout_s)
    return [list(WorkerLayout.from_wire(w).params) for w in wire]


def worker_status(llm: Any, timeout_s: float = STATUS_DEADLINE_S) -> list[WorkerStatus]:
    """Every worker's serving state, version and last outcome (diagnostics extension)."""
    wire = engine_call(llm, "mr_status", lambda: llm.collective_rpc("mr_status"), timeout_s)
    return [WorkerStatus.from_wire(w) for w in wire]


def received_weights(llm: Any) -> list[ReceivedWeights]:
    """Per worker, what the last ``verify=full`` refit left it holding (diagnostics extension)."""
    wire = engine_call(llm, "mr_received", lambda: llm.collective_rpc("mr_received"), HELPER_DEADLINE_S)
    return [ReceivedWeights.from_wire(w) for w in wire]


def raw_bandwidth(llm: Any, pairs: Sequence[tuple[int, int]], nbytes: int, timeout_s: float) -> list[float | None]:
    """Per worker, the raw-bandwidth probe over the engine's refit group (diagnostics extension)."""
    return list(engine_call(llm, "mr_raw_bandwidth", lambda: llm.collective_rpc(
        "mr_raw_bandwidth", args=([list(p) for p in pairs], nbytes, timeout_s)), timeout_s + 60.0))


def after_refit(llm: Any) -> None:
    """Drop KV blocks computed with the old weights (prefix cache) and a multimodal encoder's
    cached outputs (every request finished: the tests' helper after a load)."""
    engine_call(llm, "reset_prefix_cache", llm.reset_prefix_cache, HELPER_DEADLINE_S)
    if is_multimodal(llm):
        reset_encoder_cache(llm)


def reset_encoder_cache(llm: Any) -> None:
    """Drop every cached multimodal encoder output: the scheduler's record and the workers'
    tensors together (``EngineCore.reset_encoder_cache``). A worker's alone would leave the
    scheduler counting on outputs that are gone ("Encoder cache miss", a dead engine)."""
    if isinstance(llm, AsyncEngine):
        fn = llm.reset_encoder_cache
    elif hasattr(llm, "llm_engine"):
        fn = llm.llm_engine.reset_encoder_cache
    else:  # a handle that forwards the engine's calls
        fn = llm.reset_encoder_cache
    engine_call(llm, "reset_encoder_cache", fn, HELPER_DEADLINE_S)


def is_multimodal(llm: Any) -> bool:
    """Whether ``llm`` serves a multimodal model (one with an encoder cache to keep right)."""
    engine = llm.engine if isinstance(llm, AsyncEngine) else getattr(llm, "llm_engine", llm)
    return bool(getattr(getattr(engine, "model_config", None), "is_multimodal_model", False))


def check_serving(llm: Any, timeout_s: float = STATUS_DEADLINE_S) -> None:
    """Raise ``RefitIncomplete`` when the engine is gated (its scheduler paused by a refit
    driver after a refit it could not confirm): vLLM would queue the request and never run
    it, so a helper that waits for the answer says why instead of waiting. Raises
    ``EngineUnresponsive`` when the engine does not answer within ``timeout_s``."""
    ask = llm.is_sleeping if isinstance(llm, AsyncEngine) else llm.llm_engine.is_sleeping
    if engine_call(llm, "is_sleeping", ask, timeout_s):
        raise RefitIncomplete("this engine is not serving: it is gated (its scheduler paused) until a refit "
                              "succeeds -- the last refit did not commit on all of its workers")


def greedy(llm: Any, prompts_token_ids: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions (token ids) of each prompt."""
    from vllm import SamplingParams

    check_serving(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = engine_call(llm, "generate", lambda: llm.generate([{"prompt_token_ids": list(p)} for p in prompts_token_ids],
                                                             sp, use_tqdm=False), HELPER_DEADLINE_S)
    return [list(o.outputs[0].token_ids) for o in outs]


def prompt_logprobs(llm: Any, token_ids: Sequence[int], image: Any = None) -> list[float]:
    """Log-probability of each given token after its prefix (len(token_ids) - 1 values);
    ``image``: the prompt's image (a vision-language model's, PIL), whose placeholder tokens
    ``token_ids`` holds already expanded (one per patch, as vLLM's processor leaves them)."""
    from vllm import SamplingParams

    check_serving(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
    if image is not None:
        prompt["multi_modal_data"] = {"image": image}
    out = engine_call(llm, "generate", lambda: llm.generate([prompt], sp, use_tqdm=False), HELPER_DEADLINE_S)[0]
    vals = []
    for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):  # as the engine ran it (images expanded)
        vals.append(float(lp[tok].logprob))
    return vals


#: One sampled completion: its token ids, their logprobs and the weight versions that produced
#: them as ``(version, start, end)`` spans over the token indexes (vLLM's ``weight_versions``).
Completion = tuple[list[int], list[float], list[tuple[str, int, int]]]


def sample(llm: Any, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
           seed: int, peft: Any = None, images: Sequence[Any] | None = None,
           never: Sequence[int] = ()) -> list[list[Completion]]:
    """``n`` sampled completions per prompt of ``llm`` (``LLM`` or ``AsyncEngine``), with vLLM's
    raw logprobs of the sampled tokens (before temperature, as the trainer computes them). A
    LoRA policy's requests name the engine's refit adapter; ``images``: each prompt's image (a
    vision-language policy's; its placeholder in the prompt, once); ``never``: token ids no
    completion may hold (an image placeholder: megatron's LLaVA would read one as an image),
    biased out of sampling (the logprobs stay raw)."""
    from vllm import SamplingParams

    from .lora_slots import refit_lora_request

    check_serving(llm)
    sp = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=seed,
                        logit_bias={int(t): -100.0 for t in never} or None)
    lora = {"lora_request": refit_lora_request(peft)} if peft is not None else {}
    reqs: list[dict[str, Any]] = [{"prompt_token_ids": p} for p in prompts]
    for req, image in zip(reqs, images or ()):
        req["multi_modal_data"] = {"image": image}
    outs = llm.generate(reqs, sp, use_tqdm=False, **lora)
    return [completions(o, n) for o in outs]


def close_engine(llm: Any) -> None:
    """Close the engine's refit group, then stop the engine (best effort on the way out)."""
    for fn in (lambda: llm.shutdown_weight_transfer_engine(), lambda: stop_engine(llm)):
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


def completions(out: Any, n: int) -> list[Completion]:
    """A finished ``RequestOutput``'s ``n`` completions with the sampled tokens' logprobs and the
    weight-version spans vLLM stamped on them."""
    if len(out.outputs) != n:
        raise RuntimeError(f"request {out.request_id}: {len(out.outputs)} completions, asked for {n}")
    got = []
    for c in out.outputs:
        spans = [(str(sp.version), int(sp.start), int(sp.end)) for sp in (c.weight_versions or [])]
        got.append((list(c.token_ids), [float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs)], spans))
    return got
