"""The C++ CPU kernels' AVX-512 paths (group advantages, selective log-probs, the GRPO loss): each runs where the
CPU has AVX-512 and falls back to a portable loop elsewhere. `simd(False)` sends all three down the portable loops,
in this process, to compare the two (accuracy studies, seed-spread runs on one CPU with the other's paths).

    from grpo_kernels import cpu
    cpu.simd_enabled()        # True where the AVX-512 paths run
    cpu.simd(False)           # the portable loops from now on; cpu.simd(True) turns the paths back on
"""

from . import _C

__all__ = ["simd", "simd_enabled"]

_SWITCHES = (_C.set_cpu_simd, _C.set_logprobs_simd, _C.set_loss_simd)


def simd(enabled: bool) -> None:
    """Turn the AVX-512 paths of all three ops on (where the CPU has them) or off."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be a bool, got {enabled!r}")
    for switch in _SWITCHES:
        switch(enabled)


def simd_enabled() -> bool:
    """True when every op's AVX-512 path runs (the CPU has AVX-512 and `simd(False)` has not turned them off)."""
    return bool(_C.cpu_simd() and _C.logprobs_simd() and _C.loss_simd())
