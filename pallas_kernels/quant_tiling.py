"""How a quantized matmul's grid is cut (quant_matmul.py): row and column tiles of powers of
two, and the contraction split across programs only where the tiles alone are too few to fill
the GPU; in experts mode a row a program, the contraction split a loop step a program unless
told otherwise."""

from __future__ import annotations


def pow2_within(n: int, lo: int, hi: int) -> int:
    """The power of two nearest above n, within [lo, hi]."""
    return max(lo, min(hi, 1 << max(n - 1, 0).bit_length()))


def tiling(M: int, N: int, n_blocks: int, U: int, block_m=64, block_n=64, min_programs=264):
    """(BM, BN, S, steps): tile sizes, contraction splits and U-block steps per split.

    Splits only where row and column tiles alone give fewer than `min_programs` programs, and
    never more than one per step.
    """
    BM, BN = pow2_within(M, 16, block_m), pow2_within(N, 16, block_n)
    tiles = -(-M // BM) * -(-N // BN)
    n_steps = -(-n_blocks // U)
    S = max(1, min(n_steps, min_programs // tiles))
    steps = -(-n_steps // S)  # per split; the last split's tail is masked
    return BM, BN, -(-n_steps // steps), steps


def expert_tiling(N: int, n_blocks: int, U: int, block_n: int, splits: int | None = None):
    """(BN, S, steps) of quant_matmul's experts mode (BM 1: a (token, expert) pair a row):
    `splits` contraction splits (None: one U-block step each), each a loop over its steps, the
    last split's tail masked."""
    n_steps = -(-n_blocks // U)
    S = n_steps if splits is None else max(1, min(splits, n_steps))
    steps = -(-n_steps // S)
    return pow2_within(N, 16, block_n), -(-n_steps // steps), steps
