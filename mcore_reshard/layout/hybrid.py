"""What a hybrid family's spec carries beyond attention + MLP: each HF layer's mixer and the
sizes of the Mamba2 and gated-delta-net mixers (Nemotron-H, Qwen3-Next).

The tables (``layout/families/nemotron_h.py``, ``qwen3_next.py``) read these; the mixer
symbols are megatron-core's ``hybrid_layer_allocation.Symbols``: ``M`` Mamba2, ``G`` GDN,
``*`` attention, ``-`` MLP, ``E`` MoE. Metadata only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Mamba", "GDN", "Hybrid", "A_LOG_DTYPE"]

#: ``A_log``'s element type whatever the model dtype: vLLM keeps it in fp32 (Mamba's derived
#: ``A``, GDN's raw ``A_log``). megatron-core builds it in fp32 but a bf16 policy's
#: ``Float16Module`` casts it with every other parameter, so the trainers widen their copy when
#: sending (``Placement.widened``, exact); a plan in another wire dtype carries it as its bits.
A_LOG_DTYPE = "float32"


@dataclass(frozen=True, slots=True)
class Mamba:
    """Mamba2 mixer sizes (HF ``NemotronHConfig`` names in comments)."""

    heads: int  # mamba_num_heads
    head_dim: int  # mamba_head_dim
    groups: int  # n_groups
    state: int  # ssm_state_size
    conv_kernel: int  # conv_kernel
    conv_bias: bool = True  # use_conv_bias

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """``conv1d`` channels ``[x | B | C]``."""
        return self.d_inner + 2 * self.groups * self.state

    @property
    def in_proj_rows(self) -> int:
        """``in_proj`` rows ``[z | x | B | C | dt]``."""
        return 2 * self.d_inner + 2 * self.groups * self.state + self.heads


@dataclass(frozen=True, slots=True)
class GDN:
    """Gated-delta-net sizes (HF ``Qwen3NextConfig`` ``linear_*`` names)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def ratio(self) -> int:
        """Value heads per key head: each key head's group in ``in_proj_qkvz`` holds this many."""
        return self.v_heads // self.k_heads

    @property
    def group_rows(self) -> int:
        """Rows of one key-head group in HF's ``in_proj_qkvz``: ``[q_g; k_g; v_g; z_g]``."""
        return 2 * self.k_dim + 2 * self.ratio * self.v_dim

    @property
    def conv_dim(self) -> int:
        """``conv1d`` channels ``[q (all heads); k; v]``."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


@dataclass(frozen=True, slots=True)
class Hybrid:
    """Each HF layer's mixer symbol (Nemotron-H: its one mixer; Qwen3-Next: its token mixer,
    ``G`` or ``*``) and the mixers' sizes."""

    mixers: tuple[str, ...]
    mamba: Mamba | None = None
    gdn: GDN | None = None
