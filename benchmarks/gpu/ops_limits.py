"""The ops against the hardware's limits, on one H100/H200: one stage, < 3 minutes.

    python -m benchmarks.gpu.ops_limits --out DIR               # on the GPU machine (writes DIR/ops_limits.csv)
    python -m benchmarks.gpu.ops_limits --dry-run --out DIR     # anywhere: every row at tiny shapes on the CPU

Rows (one CSV, `kind,op,shape,provider,value,unit,note`):
  - grpo_loss fwd+bwd at T = 131,072 (64 x 2,048, fp32, dapo + KL): torch.compile of the reference (default mode)
    and ours, each timed three times (`triton.testing.do_bench` medians) in alternation; the median of the three, and
    the ratio (target: ours >= 2x compiled); per call: kernel launches and device-busy time (torch.profiler), host
    time (the Python call alone, the GPU kept ahead), host syncs (torch.cuda sync debug mode);
  - group_advantages at N = 4M, G = 16, and with variable group sizes (8..24, seeded): the kernel alone (its
    device time in the profiler) against a copy of the same bytes (4M fp32 read, 4M fp32 written: the copy kernel's
    device time in the same profile; 32 MB fits in L2 for both), target >= 70 %; the whole call (do_bench) as a
    share of that copy's bandwidth, target >= 20 %; host time and host syncs per call (nan="invalid": target none;
    nan="error": one);
  - determinism: grpo_loss (loss, every metric, the gradient) and group_advantages repeated 20 times, bitwise equal.
The dry run runs the same code on the CPU (the C++ kernels) at small shapes with torch.compile and the profiler's
device times left out (NaN), so the CSV and every code path are exercised without a GPU.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

import grpo_kernels
from benchmarks.common import write_csv
from benchmarks.gpu import stage_args
from benchmarks.gpu.check import Env
from grpo_kernels import reference

LOSS = dict(loss_type="dapo", beta=0.04, epsilon_high=0.28)
FIELDS = ["kind", "op", "shape", "provider", "value", "unit", "note"]
REPEATS = 20


class Stage:
    """Device, shapes and timers of this run (CUDA, or the CPU dry run); rows written to the CSV as they come."""

    def __init__(self, dry: bool, out: Path):
        self.dry = dry
        self.device = torch.device("cpu" if dry else "cuda")
        self.out = out
        self.rows: list[dict] = []

    def row(self, kind, op, shape, provider, value, unit, note=""):
        self.rows.append(dict(kind=kind, op=op, shape=shape, provider=provider, value=value, unit=unit, note=note))
        write_csv(self.rows, self.out, FIELDS)
        print(f"  {kind:11s} {op:22s} {shape:26s} {provider:10s} {value} {unit} {note}", flush=True)

    def bench_ms(self, fn) -> float:
        """gpu_check's timer: do_bench's median on the GPU; in the dry run the second of two calls' wall time."""
        return Env(self.dry, quick=True).time_ms(fn)

    def host_us(self, fn, calls: int = 200) -> float:
        """Microseconds of host time per call: the calls issued back to back, the GPU synchronized only at the end
        (the call returns before its kernels end; a queue this short never fills)."""
        fn()
        self.sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        self.sync()
        return elapsed / calls * 1e6

    def sync(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()

    def profile(self, fn, calls: int = 5) -> tuple[float, dict[str, float]]:
        """(kernel launches per call, {kernel name: device microseconds per call}); ({} of times in the dry run)."""
        from torch.profiler import ProfilerActivity, profile

        fn()
        self.sync()
        activities = [ProfilerActivity.CPU] + ([] if self.dry else [ProfilerActivity.CUDA])
        with profile(activities=activities) as prof:
            for _ in range(calls):
                fn()
            self.sync()
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        # Events that ran on the device (kernels, memcpy, memset): a host op's row repeats its kernels' time.
        device = {e.key: e.self_device_time_total / calls for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0}  # fmt: skip
        return launches / calls, device

    def host_syncs(self, fn) -> int:
        """Device-to-host synchronisations one call makes (gpu_profile's count; 0 in the dry run: no device)."""
        if self.dry:
            fn()
            return 0
        from benchmarks.gpu.profile_ops import host_syncs

        return len(host_syncs(fn))


# --------------------------------------------------------------------------------------------------- the loss
def loss_inputs(stage: Stage, b: int, length: int):
    g = torch.Generator().manual_seed(0)
    logps = (-torch.rand(b, length, generator=g) * 3).to(stage.device).requires_grad_()
    old = logps.detach() + 0.1 * torch.randn(b, length, generator=g).to(stage.device)
    ref = logps.detach() + 0.1 * torch.randn(b, length, generator=g).to(stage.device)
    mask = (torch.rand(b, length, generator=g) > 0.1).float().to(stage.device)
    return logps, old, ref, mask, torch.randn(b, generator=g).to(stage.device)


def loss_rows(stage: Stage) -> None:
    b, length = (4, 64) if stage.dry else (64, 2048)
    shape = f"T={b * length} dapo+KL"
    logps, old, ref, mask, adv = loss_inputs(stage, b, length)
    grad_out = torch.ones((), device=stage.device)

    def ours():
        loss, _ = grpo_kernels.grpo_loss(logps, old, adv, ref_logps=ref, mask=mask, **LOSS)
        torch.autograd.grad(loss, logps, grad_out)

    def eager_ref():
        return reference.grpo_loss(logps, old, adv, ref_logps=ref, mask=mask, **LOSS)[0]

    compiled_ref = None if stage.dry else torch.compile(eager_ref)

    def compiled():
        torch.autograd.grad(compiled_ref(), logps, grad_out)

    providers = {"ours": ours} if stage.dry else {"compiled": compiled, "ours": ours}
    times = {p: [] for p in providers}
    for _ in range(3):  # alternated, so that a drift of the machine meets both
        for p, fn in providers.items():
            times[p].append(stage.bench_ms(fn))
    medians = {p: statistics.median(t) for p, t in times.items()}
    for p, med in medians.items():
        note = f"three timings {', '.join(f'{t:.3f}' for t in times[p])}"
        if "compiled" in medians:
            note += f"; {medians['compiled'] / med:.2f}x compiled"
        stage.row("time", "grpo_loss fwd+bwd", shape, p, f"{med:.4f}", "ms", note)
    launches, device = stage.profile(ours)
    stage.row("launches", "grpo_loss fwd+bwd", shape, "ours", f"{launches:.0f}", "per call")
    if device:
        stage.row("device", "grpo_loss fwd+bwd", shape, "ours", f"{sum(device.values()):.1f}", "us per call",
                  "device busy")  # fmt: skip
    stage.row("host", "grpo_loss fwd+bwd", shape, "ours", f"{stage.host_us(ours):.1f}", "us per call")
    stage.row("syncs", "grpo_loss fwd+bwd", shape, "ours", str(stage.host_syncs(ours)), "per call")


# --------------------------------------------------------------------------------------- group_advantages
def advantages_rows(stage: Stage) -> None:
    n = 4096 if stage.dry else 1 << 22
    g = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 2, (n,), generator=g).float().to(stage.device)
    sizes = torch.randint(8, 25, (n // 8,), generator=g)
    sizes = sizes[: int((sizes.cumsum(0) <= n).sum())]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).to(stage.device)
    varied = rewards[: int(offsets[-1])].contiguous()
    out = torch.empty_like(rewards)
    copy_launches, copy_device = stage.profile(lambda: out.copy_(rewards))
    copy_us = sum(copy_device.values()) if copy_device else float("nan")
    copy_gbs = 8 * n / copy_us / 1e3 if copy_device else float("nan")
    stage.row("device", "copy", f"N={n} fp32", "torch", f"{copy_us:.2f}", "us", f"{copy_gbs:.0f} GB/s")
    for label, x, kw in [(f"N={n} G=16", rewards, dict(group_size=16)),
                         (f"N={varied.shape[0]} G=8..24", varied, dict(group_offsets=offsets))]:  # fmt: skip
        def call(nan="invalid", x=x, kw=kw):
            return grpo_kernels.group_advantages(x, nan=nan, **kw)

        nbytes = 8 * x.shape[0]
        launches, device = stage.profile(call)
        stage.row("launches", "group_advantages", label, "ours", f"{launches:.0f}", "per call")
        kernel = [v for k, v in device.items() if "group_advantages" in k]
        if kernel:
            share = nbytes / kernel[0] / 1e3 / copy_gbs
            stage.row("device", "group_advantages", label, "kernel", f"{kernel[0]:.2f}", "us",
                      f"{nbytes / kernel[0] / 1e3:.0f} GB/s, {share:.0%} of the copy's")  # fmt: skip
        whole = stage.bench_ms(call)
        share = nbytes / whole / 1e6 / copy_gbs if copy_device else float("nan")
        stage.row("time", "group_advantages", label, "ours", f"{whole * 1e3:.2f}", "us",
                  f"{share:.0%} of the copy's bandwidth")  # fmt: skip
        stage.row("host", "group_advantages", label, "ours", f"{stage.host_us(call):.1f}", "us per call")
        for nan in ("invalid", "error"):
            stage.row("syncs", "group_advantages", label, f"nan={nan}",
                      str(stage.host_syncs(lambda nan=nan: call(nan))), "per call")  # fmt: skip


# ------------------------------------------------------------------------------------------------ determinism
def determinism_rows(stage: Stage) -> None:
    b, length = (4, 64) if stage.dry else (64, 2048)
    logps, old, ref, mask, adv = loss_inputs(stage, b, length)

    def loss_once():
        loss, metrics = grpo_kernels.grpo_loss(logps, old, adv, ref_logps=ref, mask=mask, **LOSS)
        (grad,) = torch.autograd.grad(loss, logps)
        return torch.cat([loss[None], torch.stack(list(metrics.values())), grad.reshape(-1)])

    rewards = torch.rand(4096 if stage.dry else 1 << 22, generator=torch.Generator().manual_seed(2)).to(stage.device)

    def advantages_once():
        out = grpo_kernels.group_advantages(rewards, group_size=16, nan="invalid")
        return torch.cat([out.advantages, out.group_mean, out.group_std, out.invalid_fraction[None]])

    for op, fn in (("grpo_loss fwd+bwd", loss_once), ("group_advantages", advantages_once)):
        first = fn()
        same = sum(torch.equal(first, fn()) for _ in range(REPEATS - 1)) + 1
        stage.row("determinism", op, "", "ours", f"{same}/{REPEATS}", "bitwise equal runs")


def main(argv=None) -> None:
    args, out = stage_args("ops_limits", __doc__, "CPU, tiny shapes, no CUDA", argv)
    stage = Stage(args.dry_run, out / "ops_limits.csv")
    import triton

    name = "cpu-dry-run" if stage.dry else torch.cuda.get_device_name()
    print(f"ops_limits on {name}: torch {torch.__version__}, triton {triton.__version__}", flush=True)
    failed = []
    for part in (loss_rows, advantages_rows, determinism_rows):
        try:
            part(stage)
        except Exception as exc:  # one broken part is reported; the others still run
            failed.append(part.__name__)
            print(f"  {part.__name__}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    print(f"wrote {stage.out} ({len(stage.rows)} rows); failed: {failed or 'none'}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
