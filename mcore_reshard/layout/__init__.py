"""Descriptors and canonical model specs (pure metadata; imports no ML library)."""

from .descriptor import DTYPE_BYTES, Box, LayoutError, LocalParam, Piece, SideLayout, View, contiguous_strides
from .spec import CanonicalTensor, ModelSpec, load_model_spec, spec_from_hf_config

__all__ = [
    "DTYPE_BYTES",
    "Box",
    "View",
    "Piece",
    "LocalParam",
    "SideLayout",
    "LayoutError",
    "contiguous_strides",
    "CanonicalTensor",
    "ModelSpec",
    "load_model_spec",
    "spec_from_hf_config",
]
