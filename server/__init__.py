"""OpenAI-compatible HTTP server over the luce_jax engine loop (imports no jax)."""
