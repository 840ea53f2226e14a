"""Pallas kernels (Triton backend on GPU, interpret mode on CPU), each with its jnp reference."""
