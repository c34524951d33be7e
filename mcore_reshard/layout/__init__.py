"""Descriptors and canonical model specs (pure metadata; imports no ML library)."""

from .descriptor import DTYPE_BYTES, Box, LayoutError, LocalParam, Piece, SideLayout, View, contiguous_strides
from .dtensor import DTensorForm, NotExpressible, dtensor_form, dtensor_forms, dtensor_report, dtensor_summary
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
    "DTensorForm",
    "NotExpressible",
    "dtensor_form",
    "dtensor_forms",
    "dtensor_report",
    "dtensor_summary",
]
