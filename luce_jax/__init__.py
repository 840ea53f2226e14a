"""luce_jax: continuous-batching LLM inference on JAX/XLA."""

from .llm import LLM, Completion
from .sampling_params import SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams"]
