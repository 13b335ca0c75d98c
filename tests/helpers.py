"""Compare-to-reference helpers every op's tests use. On failure they print the worst elements."""

import torch

# Tolerance for a result computed (accumulated) at this precision, compared with an fp64 oracle.
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]  # every loss_type we support

TOLERANCES = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def _worst(actual: torch.Tensor, expected: torch.Tensor, err: torch.Tensor, k: int = 5) -> str:
    flat = err.flatten()
    k = min(k, flat.numel())
    idx = flat.topk(k).indices
    lines = []
    for i in idx.tolist():
        pos = tuple(int(p) for p in torch.unravel_index(torch.tensor(i), err.shape)) if err.dim() else ()
        lines.append(
            f"  at {pos}: actual={actual.flatten()[i].item():.9g} expected={expected.flatten()[i].item():.9g} "
            f"|err|={flat[i].item():.3g}"
        )
    return "\n".join(lines)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, name: str, rtol=None, atol=None, dtype=None):
    """|actual - expected| <= atol + rtol |expected| elementwise, NaN where and only where expected is NaN.

    Tolerances come from `TOLERANCES[dtype]` (default: float32) unless given.
    """
    tol = TOLERANCES[dtype or torch.float32]
    rtol = tol["rtol"] if rtol is None else rtol
    atol = tol["atol"] if atol is None else atol
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype == torch.bool or expected.dtype == torch.bool:
        bad = actual.cpu() != expected.cpu()
        assert not bool(bad.any()), f"{name}: {int(bad.sum())} mismatches, first at {bad.nonzero()[:5].tolist()}"
        return
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{name}: NaN at {nan_a.nonzero()[:5].tolist()} vs {nan_e.nonzero()[:5].tolist()}"
    a, e = a.nan_to_num(0.0), e.nan_to_num(0.0)
    err = (a - e).abs()
    excess = err - (atol + rtol * e.abs())
    if bool((excess > 0).any()):
        raise AssertionError(
            f"{name}: {int((excess > 0).sum())}/{err.numel()} elements outside rtol={rtol} atol={atol}; "
            f"max |err| = {err.max().item():.3g}\nworst:\n{_worst(a, e, excess)}"
        )


def assert_lowp_no_worse(actual, torch_lowp, oracle, *, name: str, factor: float = 2.0, floor: float = 1e-6):
    """A low-precision result must be no worse than `factor` x PyTorch's own low-precision error vs fp64.

    max|actual - oracle| <= factor * max|torch_lowp - oracle| + floor   (NaN positions must agree).
    """
    a, t, o = (x.detach().double().cpu() for x in (actual, torch_lowp, oracle))
    assert torch.equal(torch.isnan(a), torch.isnan(o)), f"{name}: NaN positions differ from the oracle"
    a, t, o = a.nan_to_num(0.0), t.nan_to_num(0.0), o.nan_to_num(0.0)
    ours, theirs = (a - o).abs(), (t - o).abs()
    bound = factor * theirs.max().item() + floor
    if ours.max().item() > bound:
        raise AssertionError(
            f"{name}: max error {ours.max().item():.3g} exceeds {factor} x PyTorch's low-precision error "
            f"{theirs.max().item():.3g} (+{floor:g})\nworst:\n{_worst(a, o, ours)}"
        )


def device_for(impl: str, triton_device: str) -> str:
    """Where a backend's tests put their tensors: the Triton device for "triton", the CPU for the C++ ones."""
    return triton_device if impl == "triton" else "cpu"


def run_vllm_check(script, directory, marker: str, *, timeout: int) -> dict:
    """Run a vLLM check script (`python script directory`) in its own process and return the JSON of its last
    `marker` line; fails the test when it crashes, skips it when vllm cannot be imported (fails instead under
    GRPO_REQUIRE_VLLM=1, as `make test` sets)."""
    import json
    import os
    import subprocess
    import sys

    import pytest

    proc = subprocess.run([sys.executable, str(script), str(directory)], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    lines = [line[len(marker) :] for line in proc.stdout.splitlines() if line.startswith(marker)]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"{script.name} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    results = json.loads(lines[-1])
    if "vllm_import_error" in results:
        message = f"vllm is not importable: {results['vllm_import_error']}"
        if os.environ.get("GRPO_REQUIRE_VLLM") == "1":
            pytest.fail(f"{message} (GRPO_REQUIRE_VLLM=1)")
        pytest.skip(message)
    return results
