"""vLLM's own LoRA slots against the adapter layout (``adapters/vllm/lora_rules.py``): a tiny
dense Qwen3 engine in bf16, TP2 on this CPU, loads a PEFT adapter through a ``LoRARequest``; every
worker's slot tensors equal, bit for bit, what the layout says they hold -- A and B sliced per
rank, B times alpha / r, the rank past r zero -- and the last slot stays empty (vLLM 0.32's CPU
LoRA ops read a request without an adapter from it)."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_reshard.adapters.vllm.lora_rules import slot_name, vllm_lora_layout
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.layout import load_model_spec
from mcore_reshard.layout.lora import PeftConfig, adapter_tensors
from mcore_reshard.transport.views import TORCH_DTYPES, materialize_local

pytestmark = pytest.mark.heavy


def _write_peft(path, spec, peft, seed: int = 3) -> dict[str, torch.Tensor]:
    """A random PEFT adapter directory (``adapter_config.json`` + safetensors); its tensors."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    canon = {n: torch.randn(shape, generator=g).to(TORCH_DTYPES[dt]) for n, (shape, dt) in
             adapter_tensors(spec, peft).items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file({"base_model.model." + n: t.contiguous() for n, t in canon.items()},
              str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(peft.peft_config_json()))
    return canon


def test_vllm_lora_slots_hold_what_the_adapter_layout_says(ckpt_cache, tmp_path):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from mcore_reshard.adapters.vllm.engine import start_engine, stop_engine

    ckpt = ckpt_cache.get(family="qwen3", dtype="bfloat16")
    spec = load_model_spec(ckpt, dtype="bfloat16")  # B x 3.0 rounds in bf16: the sender must round alike
    peft = PeftConfig(enabled=True, dim=4, alpha=12.0, max_lora_rank=8, max_loras=2)  # scaling 3.0
    canon = _write_peft(tmp_path / "adapter", spec, peft)
    held = {n: (t.clone().mul_(peft.scaling) if n.endswith("lora_B.weight") else t) for n, t in canon.items()}
    dst = vllm_lora_layout(spec, VllmParallel(tp=2), peft)
    llm = start_engine(str(ckpt), tp=2, dtype="bfloat16", enable_lora=True, max_lora_rank=peft.engine_rank,
                       max_loras=peft.max_loras)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        prompt = [{"prompt_token_ids": [11, 42, 7, 99, 123, 5]}]
        base = llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
        adapted = llm.generate(prompt, params, use_tqdm=False,
                               lora_request=LoRARequest("policy", 1, str(tmp_path / "adapter")))[0].prompt_logprobs
        assert base != adapted  # the adapter is live in slot 0
        names = [p.name for p in dst.for_rank(0)]
        empty = [slot_name(0, "self_attn.qkv_proj", "lora_b", 0, 1), slot_name(0, "mlp.down_proj", "lora_a", 0, 1)]
        got = llm.collective_rpc("mr_lora_slots", args=(names + empty,))
        assert len(got) == 2
        for rank in (0, 1):
            for p in dst.for_rank(rank):
                want = materialize_local(p, held)
                assert torch.equal(torch.tensor(got[rank][p.name], dtype=want.dtype), want), (rank, p.name)
            assert all(not any(map(any, got[rank][n])) for n in empty), rank
        again = llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs
        assert again == base  # a request without the adapter: the base model, untouched
    finally:
        stop_engine(llm)
