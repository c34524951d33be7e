"""A vision-language policy's refits side by side in one session: the whole policy, the policy
without its frozen tower, and the HF broadcast baseline.

    python scripts/bench_vlm.py [--json] [--repeats 3] [--workdir DIR]

A random-weight LLaVA of about the bench model's size (a CLIP ViT-B-like tower: hidden 768, 13
layers of which LLaVA uses 12, 112 px images of 14 px patches; an MLP projector; a Llama of
hidden 1024, 8 layers, vocab 32000: about 280M parameters, 1.1 GB in fp32) goes from a
megatron-core ``LLaVAModel`` on two TP ranks (the tower frozen: ``freeze_vision_model``) into one
vLLM engine on two TP ranks.

After one Adam step per round (an image+text sequence), three refits of the same weights,
in turn: the full plan (tower, projector and language model: the first refit of a frozen-tower
policy), the frozen plan (every later refit: all but the tower), and the HF broadcast
(all-gather, convert, broadcast the whole model to every inference rank). Each verified
(checksums; after the broadcast, the image+text logprobs within fp32's bound of megatron's).
Printed: bytes of each, seconds (median, min),
the frozen plan's speedup and byte ratio against the full plan, and the full plan's against
the broadcast. On this machine a speedup cannot beat the byte ratio.

``--json`` prints exactly one JSON object on stdout; everything else (vLLM logs) goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_refit import bench_main, bench_parser  # noqa: E402

from mcore_reshard.layout.families.llava import TINY_LLAVA  # noqa: E402

#: The bench LLaVA: the family's tiny config, scaled up (see the module docstring).
BENCH_LLAVA: dict[str, Any] = dict(
    vision_config=dict(TINY_LLAVA["vision_config"], hidden_size=768, intermediate_size=3072, num_hidden_layers=13,
                       num_attention_heads=12, image_size=112, projection_dim=768),
    text_config=dict(TINY_LLAVA["text_config"], hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000,
                     max_position_embeddings=1024),
    image_token_index=31999,
    image_seq_length=64,
)


def run(args: argparse.Namespace, log: Callable[..., None]) -> dict[str, Any]:
    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.adapters.vllm.rules import VllmParallel
    from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
    from mcore_reshard.infra.vlm import colour_squares
    from mcore_reshard.jobs.refit import local_cluster
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.settings.policy import RefitConfig
    from mcore_reshard.wire.protocol import RankMap

    path = Path(args.workdir) / "llava-bench"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, overrides=BENCH_LLAVA, family="llava", dtype="float32")
    spec = load_model_spec(path, dtype="float32")
    refit = RefitConfig(buffer_bytes=args.buffer_mib << 20, timeout_s=600.0, delta="off")
    image = colour_squares(spec.vision.image, [("red", 10, 10, 80)])
    tokens = [11, spec.vision.image_token] + [(7 * i + 3) % 1000 for i in range(30)]
    train = {"lr": 1e-4, "freeze_vision_model": True}
    with local_cluster(spec, path, MegatronParallel(tp=2), VllmParallel(tp=2), refit, train=train) as c:
        d = c.driver
        plans = d.plans
        rank_map = RankMap.disaggregated(d.src.world_size, d.dst.world_size)
        pairs = [(rank_map.group_rank("src", r % d.src.world_size), rank_map.group_rank("dst", r))
                 for r in range(d.dst.world_size)]
        busiest = {"full": max(plans.plan.recv_bytes()), "frozen": max(plans.frozen_plan.recv_bytes())}
        first = d.refit()
        log(f"first refit (the whole policy): {first.bytes_moved} bytes in {first.seconds:.3f}s")
        rounds: list[dict[str, float]] = []
        for i in range(args.repeats):
            c.step(tokens, image=image)
            d.plan = plans.plan  # the whole policy again
            full = d.refit()
            d.plan = plans.frozen_plan
            frozen = d.refit()
            hf = c.refit_once(transport="hf_broadcast")
            assert full.verified and frozen.verified  # checksums on every destination rank
            err = c.logprob_error(tokens, image)  # the broadcast's reload serves the trainers' weights too
            assert err < 1.001, err
            rate = c.raw_bandwidth(pairs, busiest["full"])  # gloo, every destination's pair at once
            rounds.append({"full_s": full.seconds, "frozen_s": frozen.seconds, "hf_s": hf.seconds,
                           "full_bytes": full.bytes_moved, "frozen_bytes": frozen.bytes_moved,
                           "hf_bytes": hf.bytes_moved, "token_mult_prob_error": err, "raw_bytes_per_s": rate})
            log(f"round {i}: full {full.seconds:.3f}s, frozen {frozen.seconds:.3f}s, hf {hf.seconds:.3f}s")
    last = rounds[-1]
    med = {k: statistics.median(r[k] for r in rounds) for k in ("full_s", "frozen_s", "hf_s")}
    return {
        "model_params": sum(math.prod(shape) for shape, _ in spec.tensor_table().values()),
        "tower_params": sum(math.prod(spec.tensor_table()[n][0]) for n in spec.frozen_tensors(vision_model=True)),
        "first_refit": {"bytes": first.bytes_moved, "seconds": first.seconds},
        **{k.replace("_s", "_seconds_median"): v for k, v in med.items()},
        **{k.replace("_s", "_seconds_min"): min(r[k] for r in rounds) for k in ("full_s", "frozen_s", "hf_s")},
        "full_bytes": last["full_bytes"], "frozen_bytes": last["frozen_bytes"], "hf_bytes": last["hf_bytes"],
        "frozen_speedup_median": statistics.median(r["full_s"] / r["frozen_s"] for r in rounds),
        "frozen_byte_ratio": last["full_bytes"] / last["frozen_bytes"],
        "hf_speedup_median": statistics.median(r["hf_s"] / r["full_s"] for r in rounds),
        "hf_byte_ratio": last["hf_bytes"] / last["full_bytes"],
        # the bandwidth bound: the busiest destination rank's bytes over the measured raw rate
        "raw_bytes_per_s_median": (raw := statistics.median(r["raw_bytes_per_s"] for r in rounds)),
        "full_bound_seconds": busiest["full"] / raw, "frozen_bound_seconds": busiest["frozen"] / raw,
        "rounds": rounds,
    }


def table(r: dict[str, Any]) -> str:
    from mcore_reshard.plan.report import format_bytes

    return "\n".join([
        f"LLaVA refits: {r['model_params'] / 1e6:.0f}M parameters (fp32), the tower {r['tower_params'] / 1e6:.0f}M "
        f"(frozen), megatron TP2 -> vLLM TP2",
        f"whole policy (the first refit)  {format_bytes(r['full_bytes'])}, median {r['full_seconds_median']:.3f}s "
        f"(min {r['full_seconds_min']:.3f}s)",
        f"without the frozen tower        {format_bytes(r['frozen_bytes'])}, median {r['frozen_seconds_median']:.3f}s "
        f"(min {r['frozen_seconds_min']:.3f}s)",
        f"HF broadcast baseline           {format_bytes(r['hf_bytes'])}, median {r['hf_seconds_median']:.3f}s "
        f"(min {r['hf_seconds_min']:.3f}s)",
        f"frozen vs whole                 speedup {r['frozen_speedup_median']:.2f}x   byte ratio {r['frozen_byte_ratio']:.2f}x",
        f"whole vs HF broadcast           speedup {r['hf_speedup_median']:.2f}x   byte ratio {r['hf_byte_ratio']:.2f}x",
        f"bandwidth bound (busiest rank / raw gloo {r['raw_bytes_per_s_median'] / 1e9:.2f} GB/s per pair): whole "
        f"{r['full_bound_seconds']:.3f}s, frozen {r['frozen_bound_seconds']:.3f}s",
    ])


def main() -> int:
    return bench_main(bench_parser(__doc__, 3, "rounds (step, whole refit, frozen refit, HF broadcast)").parse_args(),
                      run, table)


if __name__ == "__main__":
    sys.exit(main())
