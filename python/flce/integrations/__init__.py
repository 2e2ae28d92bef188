"""Drop-in integrations of flce into training stacks (Hugging Face transformers)."""
from .hf import causal_lm_loss, patch, patched, unpatch

__all__ = ["patch", "unpatch", "patched", "causal_lm_loss"]
