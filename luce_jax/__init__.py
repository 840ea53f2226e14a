"""luce_jax: continuous-batching LLM inference on JAX/XLA."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("luce_jax")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0+unknown"

from .llm import LLM, Completion  # noqa: E402
from .sampling_params import SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams"]
