"""luce_jax: continuous-batching LLM inference on JAX/XLA."""

from .llm import LLM, Completion
from .sampling import SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams"]
