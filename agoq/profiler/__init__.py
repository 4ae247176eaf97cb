"""agoq's profiler: what each layer of a model keeps for backward, and what quantizing it costs."""

from agoq.profiler.activations import PolicyReport, compare_policies

__all__ = ["PolicyReport", "compare_policies"]
