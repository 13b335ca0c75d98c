"""The profiler side of benchmarks/long_chains/profile_step.py, imported by the measuring worker: each decoder block's
forward labelled as a profiler range, a step run under torch's profiler, and its summary by phase and by kind of op
(CATEGORIES). It imports nothing of the long-chain driver, so the worker (one measurement) and the driver do not
import each other."""

import functools
import json
import resource
import time
from pathlib import Path

import torch

__all__ = ["CATEGORIES", "OTHER", "RANGES", "label_blocks", "profile_summary", "profiled"]


def label_blocks(blocks) -> None:
    """Each decoder block's own forward runs in a profiler range "block", so the profile tells the forward's blocks
    from the backward's recompute of them. Wraps the forward the checkpoint calls (apply before checkpoint_blocks;
    HF's gradient checkpointing calls the module, which calls forward)."""

    def labelled(forward, *args, **kwargs):
        with torch.profiler.record_function("block"):
            return forward(*args, **kwargs)

    for block in blocks:
        block.forward = functools.partial(labelled, block.forward)


def profiled(step, path):
    """(step's result, seconds): step() under torch's profiler (CPU ops); its summary (profile_summary) written to
    path as JSON."""
    plain_backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):  # the backward phase, told from autograd.grad calls inside a forward
        with torch.profiler.record_function("phase:backward"):
            return plain_backward(self, *args, **kwargs)

    before = resource.getrusage(resource.RUSAGE_SELF)
    torch.Tensor.backward = backward
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            out = step()
            elapsed = time.perf_counter() - start
    finally:
        torch.Tensor.backward = plain_backward
    after = resource.getrusage(resource.RUSAGE_SELF)
    summary = profile_summary(prof.events(), elapsed)
    summary.update(user_cpu_s=after.ru_utime - before.ru_utime, system_cpu_s=after.ru_stime - before.ru_stime,
                   minor_faults=after.ru_minflt - before.ru_minflt)  # fmt: skip
    Path(path).write_text(json.dumps(summary, indent=1))
    return out, elapsed


# op name -> category of the profile table, the first match wins: an aten name matches itself and its "_" variants
# (aten::index: aten::index_select, aten::index_put_), another pattern anywhere in the name. Self times, so every
# microsecond counts once.
CATEGORIES = (
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention", "varlen")),
    ("matmul (projections, MLP, head)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                                         "aten::linear")),
    ("copies and views (cat, split, index, pad)", ("aten::copy_", "aten::cat", "aten::clone", "aten::contiguous",
                                                     "aten::index", "aten::_to_copy", "aten::to", "aten::stack",
                                                     "aten::gather", "aten::scatter", "aten::constant_pad_nd",
                                                     "aten::pad", "aten::repeat", "aten::narrow_copy",
                                                     "aten::split", "aten::slice", "aten::select", "aten::view",
                                                     "aten::reshape", "aten::expand", "aten::transpose",
                                                     "aten::as_strided", "aten::unsqueeze", "aten::t")),
    ("allocation (empty, zeros, fill)", ("aten::empty", "aten::zeros", "aten::zero_", "aten::fill_",
                                         "aten::resize", "aten::new_empty", "aten::new_zeros", "aten::ones",
                                         "aten::full")),
    ("optimizer (AdamW)", ("Optimizer.", "aten::_foreach", "aten::lerp", "aten::addcmul", "aten::addcdiv")),
    ("autograd engine", ("autograd::", "Backward", "torch::autograd")),
)  # fmt: skip
OTHER = "elementwise, norms, activations, reductions"


def _category(name: str) -> str:
    for label, prefixes in CATEGORIES:
        if any(name == p or name.startswith(p + "_") if p.startswith("aten::") else p in name for p in prefixes):
            return label
    return OTHER


RANGES = ("block", "phase:backward")  # profiler ranges set here: their self time is the Python between the ops


def profile_summary(events, step_s: float) -> dict:
    """A step's profile in ms: self CPU time per category and the top ops; its phases by time: "backward" the
    Tensor.backward calls (the "phase:backward" ranges), of which "recompute" the blocks' forward run again inside
    them (the "block" ranges); "optimizer" its step; "forward and loss" the rest of the step (a loss that computes
    gradients in its forward with torch.autograd.grad, as the fused head does, counts there)."""
    events = [e for e in events if e.time_range.elapsed_us() >= 0]
    by_op, by_cat = {}, {}
    for e in events:
        us = e.self_cpu_time_total
        if e.name in RANGES:
            by_cat["Python and glue"] = by_cat.get("Python and glue", 0.0) + us
            continue
        by_op[e.name] = by_op.get(e.name, 0.0) + us
        cat = _category(e.name)
        by_cat[cat] = by_cat.get(cat, 0.0) + us
    spans = lambda name: [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith(name)]  # noqa
    backward, optimizer = spans("phase:backward"), spans("Optimizer.step")
    inside = lambda t: any(a <= t < b for a, b in backward)  # noqa: E731
    blocks = [e for e in events if e.name == "block"]
    recompute = sum(e.time_range.elapsed_us() for e in blocks if inside(e.time_range.start))
    phases = {"forward and loss": step_s * 1e6 - sum(b - a for a, b in backward + optimizer),
              "of which decoder blocks": sum(e.time_range.elapsed_us() for e in blocks) - recompute,
              "backward": sum(b - a for a, b in backward), "of which recompute": recompute,
              "optimizer": sum(b - a for a, b in optimizer)}  # fmt: skip
    ms = lambda d: {k: round(v / 1000, 1) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
    top = dict(list(ms(by_op).items())[:15])
    return dict(step_ms=round(step_s * 1000, 1), profiled_ms=round(sum(by_cat.values()) / 1000, 1),
                phases_ms={k: round(v / 1000, 1) for k, v in phases.items()}, categories_ms=ms(by_cat),
                top_ops_ms=top)  # fmt: skip
