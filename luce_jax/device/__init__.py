"""What runs on the accelerator: the runner (params, KV, per-slot state, compiled steps) and
on-device sampling."""
