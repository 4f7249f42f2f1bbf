"""Tensor ops with plain torch references (CUDA/cupy versions sit beside them when they exist)."""
