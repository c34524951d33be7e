"""The GRPO loop on Ray: a Megatron-Core policy, vLLM generation, a refit after every step.

Per step, as NeMo RL's ``grpo_train``: generate ``num_generations_per_prompt`` completions per
prompt (sampled, with generation logprobs) -> rewards -> group-normalised advantages -> the
policy's logprobs of the same tokens (``logprob_inference``) -> ``token_mult_prob_error``
(generation vs policy logprobs: the engine serves the weights the trainer holds) -> optional
reference logprobs (KL) -> one optimizer step (``policy_training``) -> refit through
mcore-reshard, checksums verified, ``verify=full`` every N steps (``refit``).

Asynchronous GRPO (``grpo.async_grpo.enabled``, NeMo RL's keys; engines on vLLM's AsyncLLM):
the prompts of the next ``max_trajectory_age_steps`` steps are generating while a step trains
and refits, so a batch trains up to that many policy versions after the one that started it
(older: dropped, never trained on). Every refit names its version after the policy's step
count, so each token's version is known from vLLM's ``weight_versions`` spans: the loss
weights each token by pi_prev / pi_gen (importance sampling), and ``token_mult_prob_error``
compares each token with the trainer's logprob under *the version that generated it* (the
trainers keep snapshots of the last versions), so a refit that served wrong weights is caught
as in the synchronous loop. ``in_flight_weight_updates``: the refit runs while those requests
decode (their tokens then span two versions); else it waits until they finish.

A refit that fails is retried once on the same engines; one that fails again or is not
verified, or a ``token_mult_prob_error`` above the dtype's bound, stops the run with an error
naming the parameter / rank: it never trains on a wrong engine.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ...infra.checkpoint import make_tiny_checkpoint
from ...refit.driver import RefitDriver, bytes_at_minimum
from ...errors import ConfigError, RefitError, RefitFailed
from ...plan.report import format_bytes
from ...wire.protocol import VerifyMode, one_line
from ..refit import TOKEN_MULT_PROB_BOUND, colocated_placement
from ...training.pool import TrainerSetup
from ...refit.verify import full_verification, token_mult_prob_error
from ...infra.vlm import expand_images, pixel_values
from ...settings import ColourTaskSettings
from .algorithm import (ColourSquaresTask, GrpoBatch, TargetTokensTask, completion_logprobs, group_advantages,
                        token_versions, trajectory_age)
from .ray_cluster import ActorDestination, Completion, RayJob, RayTrainerGroup, start_engines, stop_engines

__all__ = ["GrpoRun", "StepMetrics", "run_grpo"]


@dataclass(frozen=True)
class StepMetrics:
    """One step's metrics (NeMo RL's names where it has them); one JSONL line each."""

    step: int
    reward: float  # mean reward of this step's completions
    loss: float
    token_mult_prob_error: float  # generation vs policy logprobs of this step's tokens
    refit_verified: bool  # checksums on every destination rank
    refit_full_verified: bool  # verify=full ran this step and passed
    refit_bytes_moved: int
    refit_bytes_min: int
    timing: dict[str, float] = field(default_factory=dict)  # generation, logprob_inference, policy_training, refit, total
    #: Colocated runs: the part of ``refit_bytes_moved`` that stayed on its device (shared memory).
    refit_bytes_same_device: int = 0
    #: The policy version this step trained (= the engines' weight version before its refit).
    policy_version: int = 0
    #: The oldest and newest policy version that generated this step's tokens.
    generation_versions: tuple[int, int] = (0, 0)
    #: policy_version minus the oldest generating version (0 in synchronous GRPO).
    trajectory_age: int = 0
    #: Generation vs the *current* policy's logprobs (equals token_mult_prob_error when every
    #: token is on-policy; the gap is the samples' staleness, not an error).
    off_policy_token_mult_prob_error: float = 1.0
    #: Samples dropped before training because they were older than the allowed age.
    dropped_stale_samples: int = 0
    #: Bytes of earlier policy versions the busiest training rank keeps (async GRPO).
    snapshot_bytes: int = 0
    #: Delta refits (``refit.delta``): what a full refit would have moved, the part of
    #: ``refit_bytes_moved`` that was headers, whether the refit sent deltas, and changed
    #: elements / elements (1.0 for a full refit).
    refit_bytes_full: int = 0
    refit_bytes_headers: int = 0
    refit_delta: bool = False
    refit_delta_fraction: float = 1.0
    #: The canary vote (``refit.canary``): the engines' seconds in it (0.0: off), a refit that
    #: failed it having stopped the run.
    refit_canary_s: float = 0.0


class GrpoRun:
    """One GRPO job's processes and state: Ray actors for the trainers and engines, the refit
    driver on them. ``with GrpoRun(recipe) as run: run.step(0); ...`` (tests drive it a step at
    a time; :func:`run_grpo` runs the recipe)."""

    def __init__(self, recipe: Any, *, address: str | None = None, workdir: str | Path | None = None) -> None:
        self.recipe = recipe
        self.address = address if address is not None else recipe.ray.address
        self.workdir = Path(workdir) if workdir else None
        self.history: list[StepMetrics] = []
        self._closers: list[Callable[[], None]] = []
        self.trainers = self.engines = self.driver = None
        self.initial_refit = None
        self.refit_retries = 0  # failed refits recovered by one retry
        #: Optimizer steps taken = the version the engines serve after each refit ("0": the
        #: checkpoint, set by the first refit).
        self.policy_version = 0
        self._rollouts: dict[int, tuple[list[list[int]], list]] = {}  # async GRPO: step -> its _launch

    # -- set-up / shutdown ---------------------------------------------------------------
    def __enter__(self) -> "GrpoRun":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _start(self) -> None:
        r = self.recipe
        job = RayJob(self.address, r.ray.num_cpus or _cpus_needed(r))
        job.__enter__()
        self._closers.append(lambda: job.__exit__(None, None, None))
        if r.checkpoint_family is not None:  # a built-in tiny model: written where every node reads it
            if self.workdir is None:
                tmp = tempfile.TemporaryDirectory(prefix="mr_grpo_")
                self._closers.append(tmp.cleanup)
                self.workdir = Path(tmp.name)
            ckpt = make_tiny_checkpoint(self.workdir / r.model, family=r.checkpoint_family, dtype=r.dtype,
                                        seed=r.grpo.seed)
        else:
            ckpt = Path(r.model)
        timeout = max(r.refit.timeout_s, 120.0)
        # Trainers are placed first (their PACK group fills whole nodes), engines next; both
        # sides build their models at the same time.
        self.checkpoint = ckpt
        train = {"lr": r.lr, "freeze_vision_model": r.freeze_vision_model,
                 "freeze_vision_projection": r.freeze_vision_projection} if r.spec.vision is not None else {"lr": r.lr}
        setup = TrainerSetup(r.spec, r.training, str(ckpt), port=0, timeout_s=timeout, train=train, peft=r.peft,
                             mtp=r.speculative is not None)
        self.trainers = RayTrainerGroup.megatron(setup, timeout_s=timeout, wait=False)
        self._closers.append(self.trainers.close)
        engines, pgs = start_engines(str(ckpt), r.vllm.replicas, r.vllm.tp, r.dtype, r.refit.apply_mode,
                                     timeout_s=timeout, async_engine=r.async_engine, peft=r.peft,
                                     speculative_config=None if r.speculative is None else r.speculative.to_vllm())
        self.engines = engines
        self._closers.append(lambda: stop_engines(engines, pgs))
        self.trainers.started()
        placement = None
        if r.colocated:
            placement = _colocated(r, self.trainers.nodes, [e.info for e in engines])
        self.driver = RefitDriver(self.trainers, [ActorDestination(e) for e in engines], r.refit, r.spec, host=self.trainers.host,
                                  port=self.trainers.free_port, placement=placement, peft=r.peft, frozen=r.frozen)
        self.driver.__enter__()
        self._closers.append(lambda: self.driver.__exit__(None, None, None))
        if isinstance(r.task, ColourTaskSettings):  # images: a vision-language policy (checked by the recipe)
            v = r.spec.vision
            self.task = ColourSquaresTask(r.spec.vocab, r.task.prompt_length, v.image_token, v.image, r.grpo.seed)
        else:
            self.task = TargetTokensTask.from_fraction(r.spec.vocab, r.task.target_fraction, r.task.prompt_length,
                                                       r.grpo.seed)
        # The engines loaded the checkpoint with their own loaders; the first refit proves the
        # path before any step depends on it.
        self.initial_refit = self._refit(full=r.grpo.verify_full_every_n_steps > 0)

    def close(self) -> None:
        """Stop everything this run started, newest first; never raises."""
        while self._closers:
            fn = self._closers.pop()
            try:
                fn()
            except BaseException:  # noqa: BLE001 - keep closing the rest
                pass

    def placement(self) -> dict:
        """Where each side landed (recorded at start-up, so still readable after ``close``)."""
        return {"trainers": [n["node_id"] for n in self.trainers.nodes],
                "engines": [e.info["node_id"] for e in self.engines], "master": self.trainers.host}

    # -- one step --------------------------------------------------------------------------
    def _refit(self, full: bool) -> Any:
        """One refit; a failed one is retried once on the same engines (the driver rejoins the
        refit group; a gated engine resumes when the retry commits) before the run stops."""
        d = self.driver
        sides = d.plan_sides()  # what this refit's plan covers (the next one may leave a frozen tower out)
        request = replace(d.request(), version=str(self.policy_version))
        if full:
            request = replace(request, verify=VerifyMode.FULL)
        try:
            m = d.refit(request=request)
        except RefitFailed as exc:
            if d.dead:
                raise  # a dead engine must be replaced; retrying cannot help
            print(f"refit failed, retrying once: {one_line(exc)}", file=sys.stderr)
            self.refit_retries += 1
            m = d.refit(request=request)
        if not m.verified and request.verify.checksums:  # what this refit asked for, not the config's default
            raise RefitFailed(f"refit not verified: {m.notes or 'a destination rank reported no checksum pass'}")
        if full:
            note = full_verification(*sides, self.trainers.local_tensors().wait(), self.engines)
            m = replace(m, notes=m.notes + (note,))
        return m

    def _launch(self, prompts: list[list[int]], step: int, images: list | None = None) -> tuple[list[list[int]], list]:
        """Start generating every prompt's completions (``images``: each prompt's image), the
        prompts spread over the engines; returns what :meth:`_collect` waits for."""
        r, n = self.recipe, len(self.engines)
        per = [prompts[e::n] for e in range(n)]
        never = (r.spec.vision.image_token,) if images is not None else ()  # a placeholder is no completion token
        pics = [{} if images is None else {"images": images[e::n], "never": never} for e in range(n)]
        refs = [(e, eng.sample(per[e], r.grpo.num_generations_per_prompt, r.generation.max_new_tokens,
                               r.generation.temperature, r.grpo.seed * 7919 + step, **pics[e]))
                for e, eng in enumerate(self.engines) if per[e]]
        return prompts, refs

    def _collect(self, launched: tuple[list[list[int]], list]) -> list[Completion]:
        """The completions (grouped per prompt, in prompt order) of a :meth:`_launch`."""
        import ray

        r, n = self.recipe, len(self.engines)
        prompts, refs = launched
        got: dict[int, list] = {}
        for e, ref in refs:
            try:
                got[e] = ray.get(ref, timeout=r.refit.timeout_s)
            except Exception as exc:  # noqa: BLE001 - named
                raise RefitFailed(f"engine {e} failed to generate: {one_line(getattr(exc, 'cause', None) or exc)}") \
                    from None
        out: list[Completion] = []
        for i in range(len(prompts)):
            out.extend(got[i % n][i // n])
        return out

    def _drain(self) -> None:
        """Wait (with the refit timeout) until every launched generation has finished."""
        import ray

        refs = [ref for _, launched in self._rollouts.values() for _, ref in launched]
        if refs:
            _, left = ray.wait(refs, num_returns=len(refs), timeout=self.recipe.refit.timeout_s)
            if left:
                raise RefitFailed(f"{len(left)} generation request(s) still running after "
                                  f"{self.recipe.refit.timeout_s:.0f}s: the refit cannot wait for them")

    def _generate(self, prompts: list[list[int]], step: int, images: list | None = None) -> list[Completion]:
        return self._collect(self._launch(prompts, step, images))

    def _images(self, step: int, n: int, prompts: list[list[int]]) -> tuple[list | None, list[list[int]], dict]:
        """A task with images: each prompt's image, the prompts as the engines run them (each
        placeholder expanded per patch) and the trainers' ``images`` argument per sample
        (pixel values); a text task: ``(None, prompts, {})``."""
        if not isinstance(self.task, ColourSquaresTask):
            return None, prompts, {}
        v, G = self.recipe.spec.vision, self.recipe.grpo.num_generations_per_prompt
        images = self.task.images(step, n)
        pixels = pixel_values(self.checkpoint, images)
        expanded = [expand_images(p, v.image_token, v.patches) for p in prompts]
        return images, expanded, {"images": [pixels[i // G:i // G + 1] for i in range(n * G)]}

    def step(self, step: int) -> StepMetrics:
        """One GRPO step (synchronous, or asynchronous with ``grpo.async_grpo.enabled``)."""
        r = self.recipe
        a = r.async_grpo
        timing: dict[str, float] = {}
        t_all = time.perf_counter()
        G = r.grpo.num_generations_per_prompt
        t = time.perf_counter()
        dropped = 0
        images, expanded, pics = None, None, {}
        if not a.enabled:
            prompts = self.task.prompts(step, r.grpo.num_prompts_per_step)
            images, expanded, pics = self._images(step, len(prompts), prompts)
            samples = self._generate(prompts, step, images)
        else:
            # The next max_trajectory_age_steps steps' prompts generate while this one trains:
            # launched at this version, they train at most that many versions later.
            for s in range(step, min(step + a.max_trajectory_age_steps + 1, r.grpo.max_num_steps)):
                if s not in self._rollouts:
                    self._rollouts[s] = self._launch(self.task.prompts(s, r.grpo.num_prompts_per_step), s)
            launched = self._rollouts.pop(step)
            prompts, samples = launched[0], self._collect(launched)
        versions = _versions(samples)  # the policy version behind each token (vLLM's spans)
        if trajectory_age(self.policy_version, versions) > a.max_trajectory_age_steps:
            dropped = len(samples)  # never trained on: generate this step's prompts again, now
            samples = self._generate(prompts, step)
            versions = _versions(samples)
        timing["generation"] = time.perf_counter() - t
        expanded = expanded or prompts
        seqs = [expanded[i // G] + toks for i, (toks, _, _) in enumerate(samples)]
        age = trajectory_age(self.policy_version, versions)
        rewards = [self.task.score(step, i // G, toks) for i, (toks, _, _) in enumerate(samples)]
        adv = group_advantages(rewards, G, normalize=r.grpo.normalize_rewards,
                               leave_one_out=r.grpo.use_leave_one_out_baseline)
        t = time.perf_counter()
        prev = self.trainers.logprobs(seqs, **pics).wait()[0]
        P = len(expanded[0])
        # Each token against the version that generated it (snapshots of earlier versions).
        under = {self.policy_version: prev}
        for v in sorted({v for vs in versions for v in vs} - {self.policy_version}):
            under[v] = self.trainers.logprobs(seqs, v, **pics).wait()[0]
        timing["logprob_inference"] = time.perf_counter() - t
        gen_lp = [x for _, lps, _ in samples for x in lps]
        train_lp = [completion_logprobs(under[v][i], P)[j] for i, vs in enumerate(versions) for j, v in enumerate(vs)]
        tmpe = token_mult_prob_error(gen_lp, train_lp)
        off_policy = token_mult_prob_error(gen_lp, [x for lp in prev for x in completion_logprobs(lp, P)])
        bound = TOKEN_MULT_PROB_BOUND.get(r.dtype, 1.05)
        if tmpe > bound:
            raise RefitError(f"step {step}: token_mult_prob_error {tmpe:.6f} > {bound} (dtype {r.dtype}), each token "
                             f"against the policy version that generated it: the engine did not serve the weights "
                             f"the trainer held; stopping before training on its samples")
        ref = None
        if r.loss.reference_policy_kl_penalty > 0:
            t = time.perf_counter()
            ref = tuple(tuple(x) for x in self.trainers.reference_logprobs(seqs, **pics).wait()[0])
            timing["reference_logprob_inference"] = time.perf_counter() - t
        gen = tuple(tuple(lps) for _, lps, _ in samples) if r.loss.use_importance_sampling_correction else None
        batch = GrpoBatch(tuple(adv), tuple(tuple(x) for x in prev), ref, P, gen)
        snapshot_bytes = 0
        if a.enabled:  # what the batches still generating may need after this step
            v = self.policy_version
            keep = range(v + 1 - a.max_trajectory_age_steps, v + 1)
            snapshot_bytes = max(self.trainers.snapshot(v, keep).wait())
        t = time.perf_counter()
        loss = self.trainers.grpo_step(seqs, batch, r.loss, **pics).wait()[0]
        timing["policy_training"] = time.perf_counter() - t
        if a.enabled and not a.in_flight_weight_updates:
            t = time.perf_counter()  # the refit waits until the requests running now are done
            self._drain()
            timing["drain"] = time.perf_counter() - t
        n = r.grpo.verify_full_every_n_steps
        full = bool(n) and (step + 1) % n == 0
        t = time.perf_counter()
        trained_version = self.policy_version
        self.policy_version += 1
        try:
            m = self._refit(full)
        except BaseException:
            self.policy_version -= 1
            raise
        timing["refit"] = time.perf_counter() - t
        timing["total"] = time.perf_counter() - t_all
        flat = [v for vs in versions for v in vs]
        sm = StepMetrics(step, sum(rewards) / len(rewards), loss, tmpe, m.verified, full, m.bytes_moved, m.bytes_min,
                         {k: round(v, 4) for k, v in timing.items()}, m.bytes_same_device, trained_version,
                         (min(flat), max(flat)), age, off_policy, dropped, snapshot_bytes, m.bytes_full,
                         m.bytes_headers, m.delta, m.delta_fraction, round(m.phases.get("dst_canary", 0.0), 4))
        self.history.append(sm)
        return sm


def _versions(samples: Sequence[Completion]) -> list[list[int]]:
    """Per sample, the policy version that produced each token (``token_versions``)."""
    return [token_versions(spans, len(toks)) for toks, _, spans in samples]


def _colocated(recipe: Any, trainer_nodes: list[dict], engine_infos: list[dict]) -> Any:
    """``policy.generation.colocated.enabled``: training rank i and vLLM worker i share device i,
    so their bytes move through shared memory. Here a device is a CPU slot of one node; GPU
    devices would need CUDA IPC, which is not implemented (refused in one line)."""
    import ray

    if ray.cluster_resources().get("GPU", 0) > 0:
        raise ConfigError("policy.generation.colocated.enabled=true on a GPU cluster: same-GPU transfers need "
                          "CUDA IPC, which mcore-reshard does not implement yet (run the recipe non-colocated)")
    nodes = {n["node_id"] for n in trainer_nodes} | {e["node_id"] for e in engine_infos}
    if len(nodes) != 1:
        raise ConfigError(f"policy.generation.colocated.enabled=true: trainers and engines landed on {len(nodes)} "
                          f"nodes; a colocated run on CPU needs one node (shared memory between its processes)")
    return colocated_placement(recipe.training.world_size, recipe.vllm.world_size)


def _cpus_needed(recipe: Any) -> int:
    """Logical CPUs of the embedded cluster: one per training rank and per engine worker."""
    return recipe.training.world_size + recipe.vllm.replicas * recipe.vllm.tp


# ----------------------------------------------------------------------------- reporting


def write_plot(history: Sequence[StepMetrics], path: Path, title: str) -> Path:
    """Reward and refit seconds per step, one PNG (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h.step for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, [h.reward for h in history], marker="o")
    a.set_xlabel("step")
    a.set_ylabel("mean reward")
    a.set_title("reward")
    b.plot(steps, [h.timing.get("refit", 0.0) for h in history], marker="o", color="tab:orange")
    b.set_xlabel("step")
    b.set_ylabel("seconds")
    b.set_title("refit (mcore-reshard, verified)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _at_minimum(h: StepMetrics) -> bool:
    """``RefitMetrics.at_minimum`` of a step's refit."""
    return bytes_at_minimum(h.refit_bytes_moved, h.refit_bytes_min, h.refit_bytes_full, h.refit_bytes_headers,
                            h.refit_delta)


def summary_table(history: Sequence[StepMetrics], random_reward: float) -> str:
    head = (f"{'step':>4} {'reward':>7} {'loss':>8} {'tok_mult_prob_err':>17} {'refit s':>8} {'moved':>10} "
            f"{'full':>10} {'changed':>8} {'minimum':>10} {'verified':>9} {'full v':>6} {'step s':>7}")
    lines = [head, "-" * len(head)]
    for h in history:
        changed = f"{100 * h.refit_delta_fraction:.2f}%" if h.refit_delta else "full"
        lines.append(f"{h.step:>4} {h.reward:>7.3f} {h.loss:>8.4f} {h.token_mult_prob_error:>17.6f} "
                     f"{h.timing.get('refit', 0):>8.3f} {format_bytes(h.refit_bytes_moved):>10} "
                     f"{format_bytes(h.refit_bytes_full):>10} {changed:>8} "
                     f"{format_bytes(h.refit_bytes_min):>10} {str(h.refit_verified):>9} "
                     f"{'yes' if h.refit_full_verified else '':>6} {h.timing.get('total', 0):>7.2f}")
    if history:
        lines.append(f"reward {history[0].reward:.3f} at step 0 -> {history[-1].reward:.3f} at step "
                     f"{history[-1].step} (a random policy scores {random_reward:.3f}); every refit verified: "
                     f"{all(h.refit_verified for h in history)}, at the minimum bytes: "
                     f"{all(_at_minimum(h) for h in history)}")
    return "\n".join(lines)


def run_grpo(recipe: Any, *, address: str | None = None, as_json: bool = False) -> int:
    """``mcore-reshard grpo RECIPE``: run the recipe, write ``metrics.jsonl`` and ``grpo.png``
    under ``logger.log_dir``, print the summary. Returns the exit code (0: every step verified)."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from tqdm import tqdm

    log_dir = Path(recipe.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = log_dir / "metrics.jsonl"
    err = sys.stderr
    interrupted = False
    # Ctrl-C and a terminated run stop the actors the same way, whatever this process inherited:
    # a process started while its parent ignored or blocked SIGINT (a launcher, a thread of a
    # test session) would otherwise run to its last step through every Ctrl-C.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, _interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(previous))
    run = GrpoRun(recipe, address=address)
    try:
        print(f"grpo: starting Ray ({'embedded local cluster' if (address or recipe.ray.address) is None else address}), "
              f"{recipe.training.world_size} trainer actor(s), {recipe.vllm.replicas} engine(s)", file=err)
        with run, metrics_path.open("w") as f:
            bar = tqdm(range(recipe.grpo.max_num_steps), desc="grpo", file=err, unit="step")
            for step in bar:
                m = run.step(step)
                f.write(json.dumps(asdict(m)) + "\n")
                f.flush()
                bar.set_postfix(reward=f"{m.reward:.3f}", refit=f"{m.timing['refit']:.2f}s")
    except KeyboardInterrupt:
        interrupted = True
        print("grpo: interrupted; every actor stopped", file=err)
    except (RefitError, RefitFailed) as exc:
        print(f"error: {one_line(exc)}", file=err)
        return 1
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: set outside Python, nothing to restore
                signal.signal(sig, handler)
    history = run.history
    if not history:
        return 130 if interrupted else 1
    plot = write_plot(history, log_dir / "grpo.png", f"GRPO {recipe.model} ({Path(recipe.path).name})")
    random_reward = run.task.random_policy_reward
    if as_json:
        print(json.dumps({"steps": [asdict(h) for h in history], "metrics": str(metrics_path), "plot": str(plot),
                          "random_policy_reward": random_reward, "placement": run.placement()}))
    else:
        print(summary_table(history, random_reward))
        print(f"metrics: {metrics_path}\nplot: {plot}")
    return 130 if interrupted else 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
