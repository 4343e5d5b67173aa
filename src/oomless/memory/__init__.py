"""The analytic memory model (torch-free)."""

from .training import estimate_training

__all__ = ["estimate_training"]
