"""Per-rank jobs for the live megatron tests (spawned by ``run_world``; importable, picklable).

The oracle here is megatron's own ``sharded_state_dict()``: each ShardedTensor aliases a live
parameter and says which block of a megatron-global tensor it holds. The mapping from those
megatron-global tensors to HF tensors is written independently of ``rules.py`` (whole-tensor
reshapes and concatenations instead of per-piece arithmetic), so agreement checks both.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from mcore_reshard.adapters.megatron.build import build_gpt, init_megatron
from mcore_reshard.testing.worlds import WorldCtx
from mcore_reshard.adapters.megatron.live import describe, describe_world, named_local_params
from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.layout import ModelSpec, spec_from_hf_config
from mcore_reshard.transport.views import local_view
from mcore_reshard.adapters.megatron.train import forward_logits


def canonical_ids(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """A distinct int64 id for every element of every HF tensor."""
    out, base = {}, 0
    for t in spec.tensors().values():
        n = 1
        for s in t.shape:
            n *= s
        out[t.name] = torch.arange(base, base + n, dtype=torch.int64).view(t.shape)
        base += n
    return out


def _megatron_global(spec: ModelSpec, ids: dict[str, torch.Tensor], key: str, layer: int | None,
                     expert: int | None, vocab_padded: int) -> torch.Tensor:
    """Ids of the megatron-global tensor behind checkpoint ``key`` (layer / expert resolved)."""
    H, hn, ng = spec.hidden, spec.head_dim, spec.num_kv_heads
    P = spec.num_heads // ng
    hf = f"model.layers.{layer}."
    tail = key.rsplit("layers.", 1)[-1]
    tail = re.sub(r"^\d+\.", "", tail)

    def padded(name: str) -> torch.Tensor:
        t = torch.full((vocab_padded, H), -1, dtype=torch.int64)
        t[: spec.vocab] = ids[name]
        return t

    if key == "embedding.word_embeddings.weight":
        return padded("model.embed_tokens.weight")
    if key == "output_layer.weight":
        return padded("model.embed_tokens.weight" if spec.tied else "lm_head.weight")
    if key == "decoder.final_layernorm.weight":
        return ids["model.norm.weight"]
    if tail in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = tail.rsplit(".", 1)[-1]
        q, k, v = (ids[f"{hf}self_attn.{p}_proj.{kind}"] for p in "qkv")
        rest = q.shape[1:]
        groups = torch.cat([q.reshape(ng, P * hn, *rest), k.reshape(ng, hn, *rest), v.reshape(ng, hn, *rest)], 1)
        return groups.reshape(-1, *rest)
    simple = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "input_layernorm.weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.router.weight": "mlp.gate.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
        "mlp.experts.experts.linear_fc2.weight": f"mlp.experts.{expert}.down_proj.weight",
    }
    if tail in simple:
        return ids[hf + simple[tail]]
    if tail == "mlp.linear_fc1.weight":
        return torch.cat([ids[hf + "mlp.gate_proj.weight"], ids[hf + "mlp.up_proj.weight"]])
    if tail == "mlp.experts.experts.linear_fc1.weight":
        e = f"{hf}mlp.experts.{expert}."
        return torch.cat([ids[e + "gate_proj.weight"], ids[e + "up_proj.weight"]])
    raise KeyError(f"checkpoint key {key!r} not mapped by the test oracle")


def oracle_ids(chunks, spec: ModelSpec, ids: dict[str, torch.Tensor]):
    """Per live parameter: the ids megatron's sharded_state_dict places in it, and a mask of
    the elements whose ShardedTensor is the main replica (replica_id all zero)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    params = named_local_params(chunks)
    out: dict[str, torch.Tensor] = {}
    main: dict[str, torch.Tensor] = {}
    unmatched: list[str] = []
    multi = len(chunks) > 1
    for v, chunk in enumerate(chunks):
        vocab_padded = int(chunk.vocab_size)
        for sd_key, item in chunk.sharded_state_dict().items():
            if isinstance(item, ShardedTensorFactory):
                built = item.build()
                shards = list(built.values()) if isinstance(built, dict) else list(built)
            elif isinstance(item, ShardedTensor):
                shards = [item]
            else:
                continue  # _extra_state objects
            name = (f"chunk{v}." if multi else "") + sd_key
            p = params.get(name)
            if p is None or p.untyped_storage().data_ptr() != shards[0].data.untyped_storage().data_ptr():
                unmatched.append(name)
                continue
            local = out.setdefault(name, torch.full(p.shape, -1, dtype=torch.int64))
            mask = main.setdefault(name, torch.zeros(p.shape, dtype=torch.bool))
            for st in shards:
                assert st.flattened_range is None
                npre = st.prepend_axis_num
                key = st.key
                m = re.search(r"layers\.(\d+)\.", key)
                pre = list(st.global_offset[:npre])
                layer = int(m.group(1)) if m else (pre.pop(0) if "layers." in key else None)
                expert = pre.pop(0) if "experts.experts" in key else None
                glob = _megatron_global(spec, ids, key, layer, expert, vocab_padded)
                box = tuple(slice(o, o + n) for o, n in zip(st.global_offset[npre:], st.data.shape))
                offset = (st.data.data_ptr() - p.data_ptr()) // p.element_size()
                view = torch.as_strided(local, st.data.shape, st.data.stride(), offset)
                view.copy_(glob[box])
                if all(r == 0 for r in (st.replica_id if isinstance(st.replica_id, tuple) else (st.replica_id,))):
                    torch.as_strided(mask, st.data.shape, st.data.stride(), offset).fill_(True)
    return out, main, unmatched


def predicted_ids(descs, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for lp in descs:
        t = torch.full(lp.shape, -1, dtype=torch.int64)
        for pc in lp.pieces:
            local_view(t, pc.view).copy_(ids[pc.canonical][tuple(slice(o, o + n) for o, n in
                                                                 zip(pc.box.offsets, pc.box.sizes))])
        out[lp.name] = t
    return out


def layout_job(ctx: WorldCtx, par: MegatronParallel, cfg: dict[str, Any], ckpt: str | None = None,
               tokens: list[int] | None = None, train_steps: int = 0) -> dict[str, Any]:
    """Build the model, describe it, cross-check against sharded_state_dict, optionally load
    ``ckpt`` through the descriptors and run forward (and a few AdamW steps)."""
    spec = spec_from_hf_config(cfg, dtype="float32")
    init_megatron(par, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    chunks = build_gpt(spec, par, dtype="float32")
    ids = canonical_ids(spec)
    descs = describe(chunks, spec)
    world = describe_world(chunks, spec)
    oracle, main, unmatched = oracle_ids(chunks, spec, ids)
    res: dict[str, Any] = dict(
        rank=ctx.rank, descs=descs, world_params=world.params, notes=world.notes,
        predicted=predicted_ids(descs, ids), oracle=oracle, main=main, unmatched=unmatched,
        live_names=sorted(named_local_params(chunks)),
    )
    if ckpt is None:
        return res
    from mcore_reshard.transport.views import write_pieces
    from mcore_reshard.infra.checkpoint import load_canonical

    tensors = load_canonical(ckpt)
    params = named_local_params(chunks)
    with torch.no_grad():
        for lp in descs:
            params[lp.name].data.zero_()
            write_pieces(params[lp.name].data, lp.pieces, tensors)
    model = chunks[0]
    x = torch.tensor([tokens])
    model.eval()
    with torch.no_grad():
        res["logits"] = forward_logits(model, x, spec.vocab)[0]
    if ctx.rank == 0:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        with torch.no_grad():
            res["hf_logits"] = hf(x).logits[0]
    if train_steps:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        labels = torch.roll(x, -1, dims=1)
        losses = []
        for _ in range(train_steps + 1):
            loss = torch.nn.functional.cross_entropy(forward_logits(model, x, spec.vocab)[0], labels[0])
            losses.append(float(loss))
            opt.zero_grad()
            loss.backward()
            opt.step()
        res["losses"] = losses
    return res
