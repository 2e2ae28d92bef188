"""flce: fused, collapse-safe linear cross-entropy for large-vocabulary language models,
collapse-safe cross-entropy on given logits, and collapse-safe distillation of two classifiers."""
from . import reference
from ._build import build_info
from ._common import ArgumentError, DtypeError
from ._ops import ops
from .api import LinearCrossEntropy, cross_entropy, linear_cross_entropy
from .distill import LinearDistillation, linear_distillation
# transformers is imported only when a model is patched.
from .integrations import patch, patched, unpatch

__all__ = ["linear_cross_entropy", "LinearCrossEntropy", "cross_entropy", "linear_distillation",
           "LinearDistillation", "reference", "ops", "patch", "unpatch", "patched", "build_info",
           "ArgumentError", "DtypeError"]
__version__ = "0.1.0"
