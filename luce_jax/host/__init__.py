"""The request path on the host, pure Python and NumPy (no jax): loop -> scheduler -> engine,
with the slot table, KV pool and step lowering they share."""
