"""The analytic memory model (torch-free)."""

from .inference import estimate_generate, vllm_budget
from .training import estimate_training

__all__ = ["estimate_generate", "estimate_training", "vllm_budget"]
