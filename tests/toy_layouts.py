"""Library-free layouts for planner unit tests: each canonical tensor split along one dim."""

from __future__ import annotations

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.layout import Box, LocalParam, ModelSpec, Piece, SideLayout, View, contiguous_strides


def split_layout(tensors: dict[str, tuple[tuple[int, ...], str]], *, parts: int, dim: int, replicas: int = 1,
                 pad_rows: int = 0, name: str = "toy") -> SideLayout:
    """Rank ``rep * parts + r`` holds chunk ``r`` of every tensor along ``dim`` (the last dim
    for 1-D tensors), plus ``pad_rows`` uncovered rows at the end of its local tensor."""
    params = []
    for rep in range(replicas):
        for r in range(parts):
            rank = rep * parts + r
            for cname, (shape, dtype) in tensors.items():
                d = min(dim, len(shape) - 1)
                if shape[d] % parts:
                    raise ValueError(f"{cname}: dim {d} of {shape} not divisible by {parts}")
                n = shape[d] // parts
                offs = [0] * len(shape)
                offs[d] = r * n
                sizes = list(shape)
                sizes[d] = n
                local_shape = list(sizes)
                local_shape[0] += pad_rows
                view = View(0, tuple(sizes), contiguous_strides(local_shape))
                piece = Piece(rank, "local." + cname, cname, Box(tuple(offs), tuple(sizes)), view)
                params.append(LocalParam(rank, "local." + cname, tuple(local_shape), dtype, (piece,)))
    return SideLayout(name, parts * replicas, tuple(params), dict(tensors))


def tiny_spec(*, moe: bool = True, tied: bool = False, nkv: int = 2, p: int = 4, vocab: int = 250,
              bias: bool = False, layers: int = 4, dtype: str = "float32", experts: int = 8,
              moe_layers: tuple[int, ...] | None = None) -> ModelSpec:
    return ModelSpec(
        arch="qwen3_moe" if moe else "qwen3", hidden=16, num_layers=layers, num_heads=nkv * p,
        num_kv_heads=nkv, head_dim=4, intermediate=32, vocab=vocab, tied=tied, qkv_bias=bias,
        qk_norm=True, num_experts=experts if moe else 0, moe_intermediate=8 if moe else 0,
        moe_topk=2 if moe else 0,
        moe_layers=(tuple(range(layers)) if moe_layers is None else moe_layers) if moe else (), dtype=dtype,
    )


#: Named corner cases of both rule sets: (tiny_spec kwargs, training sizes, vLLM sizes).
NAMED_LAYOUTS = {
    "dense tp2 -> tp1": (dict(moe=False), MegatronParallel(tp=2), VllmParallel(tp=1)),
    "ng<tp split inside a head (ng=1, P=4, tp=4)": (dict(moe=False, nkv=1, p=4), MegatronParallel(tp=4), VllmParallel(tp=4)),
    "ng<tp, kv replicated in vLLM": (dict(moe=False, nkv=1, p=4), MegatronParallel(tp=2), VllmParallel(tp=4)),
    "qkv bias, tied, dp replicas": (dict(moe=False, bias=True, tied=True), MegatronParallel(tp=2, dp=2), VllmParallel(tp=2, replicas=2)),
    "uneven pp + vpp": (dict(moe=False, layers=6), MegatronParallel(pp=2, vpp=3), VllmParallel(pp=2)),
    "uneven first/last stage": (dict(moe=False, layers=5), MegatronParallel(pp=2, first_stage_layers=2), VllmParallel(pp=1)),
    "moe ep2 etp1 -> vllm tp2": (dict(), MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2)),
    "moe etp2 != tp1 grouped te": (dict(), MegatronParallel(tp=1, ep=2, etp=2, dp=4, layer_spec="te", experts="grouped"), VllmParallel(tp=4)),
    "moe -> vllm ep + redundant": (dict(), MegatronParallel(ep=4, dp=4), VllmParallel(tp=2, dp=2, enable_ep=True, num_redundant_experts=4)),
    "moe -> vllm dp moe-tp flatten": (dict(), MegatronParallel(tp=2, pp=2, ep=2, etp=1), VllmParallel(tp=2, dp=2)),
    "mixed dense/moe layers bf16": (dict(moe_layers=(1, 3), dtype="bfloat16"), MegatronParallel(tp=2, ep=2, etp=1, pp=2), VllmParallel(tp=2, pp=2)),
    "padded vocab both sides": (dict(vocab=1000), MegatronParallel(tp=4), VllmParallel(tp=2, replicas=2)),
}
