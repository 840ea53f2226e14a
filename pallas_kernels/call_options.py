"""What every kernel's pallas_call shares: whole-array operands and the Triton options."""

from __future__ import annotations

import jax
import jax.extend.backend
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def whole(a) -> pl.BlockSpec:
    """The whole array as one block: the kernel indexes it itself (gathers through tables,
    masked loads), as the Triton backend has no scalar prefetch."""
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def call_options(interpret: bool | None, num_warps: int, num_stages: int, *, name: str) -> dict:
    """pallas_call's interpret flag (default: on the CPU, where there is no Triton), the
    kernel's name and, on the GPU, the Triton compiler parameters. The name is what a profile
    shows for the launch (bench/engine/profile_step.py): every kernel function here is
    `_kernel`, which profiles told apart only as `_kernel__1`, `_kernel__2`, ..."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if interpret:
        return {"interpret": True, "name": name}
    return {
        "interpret": False,
        "name": name,
        "compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    }


def uses_ptx(interpret: bool | None) -> bool:
    """Whether a Triton kernel may hold PTX: not in interpret mode and not on a ROCm backend.
    Lowering for cuda from the CPU (tests, bench/kernels/kernel_ptx.py) takes the PTX."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return not interpret and "rocm" not in jax.extend.backend.get_backend().platform_version
