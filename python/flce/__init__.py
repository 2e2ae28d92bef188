"""flce: fused, collapse-safe linear cross-entropy for large-vocabulary language models."""
from . import reference
from ._ops import ops
from .api import LinearCrossEntropy, linear_cross_entropy
# transformers is imported only when a model is patched.
from .integrations import patch, patched, unpatch

__all__ = ["linear_cross_entropy", "LinearCrossEntropy", "reference", "ops", "patch", "unpatch",
           "patched"]
__version__ = "0.1.0"
