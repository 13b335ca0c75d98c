"""Grouped advantage normalization: Triton kernel, launcher, op registration, autograd.

Design. A GRPO batch holds few rewards (N up to a few million) split into many small groups (G = 2..1024), so one
program per group would leave most lanes idle. Each program takes BLOCK_G groups as the rows of a [BLOCK_G, BLOCK_M]
tile of TILE = 256 elements over 4 warps (a longer group gets a 1 x BLOCK_M tile, BLOCK_M <= 256): the largest tile
and group row with which every shape compiles without spills on Triton 3.6 and 3.9 (`python -m
grpo_kernels.ops.aot_report` compiles every shape). Groups are contiguous blocks of `group_size`, or segments read
from `group_offsets` (cu_seqlens-style) when sizes vary (rows of twice the mean size then). When every group of a
program fits in one row (always, for group_size <= 256), the program reads its rewards once and keeps the tile in
registers for the scale, the moments and the advantages. Otherwise it walks each group in chunks three times: the
scale, then (count, mean, M2) merged with Chan's parallel formula, then the advantages. Either way the variance is
two-pass accurate and any group size works; values are divided by a power of two near the group's largest |reward|
(exact), so squares cannot overflow fp32 even for rewards near 3e38, and shifted by the group's first reward, so an
all-equal group has exactly zero variance whatever its magnitude. Everything is accumulated in fp32; K reward
columns are combined with their weights on load, so the [N] combined reward never hits memory.

One launch, no aten glue, no host sync: invalid_fraction and the number of groups with a non-finite reward are
integer counts that every program adds atomically (an integer sum does not depend on the order, so the result is
deterministic) and the last program to take a ticket turns into the outputs, setting the counters (one int32 [3] per
device and stream) back to zero. With nan="error" the public function reads that one count (its one host sync).
"batch" scaling needs the std of the whole batch, which depends on every group: the kernel writes the unscaled
r - mean, the batch std is combined from the per-group (n, mean, std) in a few O(num_groups) torch ops, and one
multiply scales the advantages (exact zeros stay zeros, even when eps = 0 makes the factor inf).

Hyperparameters (eps, min_std, the std correction, the scale mode) are runtime arguments; only the tile
shape and whether offsets are given are compile-time.
"""

import torch
import triton
import triton.language as tl

from .. import _C
from ..types import group_sizes
from ._triton import require_triton_device, stream_counters

SCALE_MODES = {"group": 0, "batch": 1, "none": 2}
TILE = 256  # elements per program (e.g. 16 groups of 16): the largest tile that compiles without spills
MAX_BLOCK_M = 256  # longer groups are walked in chunks (with 512 or 1024, fp64 rewards spill on Triton 3.9)
NUM_WARPS = 4


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _combined_rewards(r_ptr, rows, mask, stride_n, stride_k, w_ptr, K):
    acc = tl.zeros(rows.shape, dtype=tl.float32)
    for k in range(K):
        w = tl.load(w_ptr + k)
        x = tl.load(r_ptr + rows * stride_n + k * stride_k, mask=mask, other=0.0)
        acc += w * x.to(tl.float32)
    return acc


@triton.jit
def _scaled_stats(x, in_group, scale, shift):
    """One chunk's (count, mean, M2, non-finite count) of the scaled, shifted rewards of each group (row)."""
    finite = (x == x) & (tl.abs(x) < float("inf"))
    nbad = tl.sum((in_group & ~finite).to(tl.float32), axis=1)
    x = tl.where(in_group & finite, x / scale[:, None] - shift[:, None], 0.0)
    cnt = tl.sum(in_group.to(tl.float32), axis=1)
    mean = tl.sum(x, axis=1) / tl.maximum(cnt, 1.0)
    dev = tl.where(in_group, x - mean[:, None], 0.0)
    return cnt, mean, tl.sum(dev * dev, axis=1), nbad


@triton.jit
def _pow2_scale(amax):
    """A power of two at or above the largest finite |reward| (1 for none): dividing by it is exact."""
    return tl.where(amax > 0, tl.math.exp2(tl.minimum(tl.math.ceil(tl.math.log2(amax)), 127.0)), 1.0)


@triton.jit
def _finite_abs(x, in_group):
    return tl.where(in_group & (x == x) & (tl.abs(x) < float("inf")), tl.abs(x), 0.0)


@triton.jit
def _group_advantages_kernel(
    r_ptr, stride_n, stride_k, w_ptr, K,
    offsets_ptr, group_size, num_groups,
    adv_ptr, mean_ptr, std_ptr, valid_ptr, counts_ptr, frac_ptr, nbad_ptr,
    eps, correction, min_std, scale_mode,
    HAS_OFFSETS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = g < num_groups
    if HAS_OFFSETS:
        start = tl.load(offsets_ptr + g, mask=g_mask, other=0).to(tl.int64)
        end = tl.load(offsets_ptr + g + 1, mask=g_mask, other=0).to(tl.int64)
    else:
        start = g * group_size
        end = tl.where(g_mask, start + group_size, start)
    n = end - start
    cols = tl.arange(0, BLOCK_M)
    # The group's first reward: the shift that gives an all-equal group exactly zero variance.
    shift = _combined_rewards(r_ptr, start, g_mask, stride_n, stride_k, w_ptr, K)
    shift = tl.where((shift == shift) & (tl.abs(shift) < float("inf")), shift, 0.0)
    fits = tl.max(n, axis=0) <= BLOCK_M  # every group of this program in one row of the tile
    if fits:
        # One read: the tile stays in registers for the scale, the moments and the advantages.
        in_tile = cols[None, :] < n[:, None]
        x_tile = _combined_rewards(r_ptr, start[:, None] + cols[None, :], in_tile, stride_n, stride_k, w_ptr, K)
        scale = _pow2_scale(tl.max(_finite_abs(x_tile, in_tile), axis=1))
        shift = shift / scale
        cnt, mean, m2, nbad = _scaled_stats(x_tile, in_tile, scale, shift)
    else:
        # Walk 0: the power-of-two scale of each group's largest finite |reward|: squared deviations of the
        # scaled rewards cannot overflow fp32 whatever their magnitude.
        in_tile = cols[None, :] < (n * 0)[:, None]  # (unread: the tile of the one-read path)
        x_tile = tl.zeros((BLOCK_G, BLOCK_M), dtype=tl.float32)
        amax = tl.zeros((BLOCK_G,), dtype=tl.float32)
        for m0 in range(0, tl.max(n), BLOCK_M):
            in_group = (m0 + cols)[None, :] < n[:, None]
            x = _combined_rewards(r_ptr, start[:, None] + m0 + cols[None, :], in_group, stride_n, stride_k, w_ptr, K)
            amax = tl.maximum(amax, tl.max(_finite_abs(x, in_group), axis=1))
        scale = _pow2_scale(amax)
        shift = shift / scale
        # Walk 1: count, mean, M2 and the non-finite count, chunks merged with Chan's formula.
        cnt = tl.zeros((BLOCK_G,), dtype=tl.float32)
        mean = tl.zeros((BLOCK_G,), dtype=tl.float32)
        m2 = tl.zeros((BLOCK_G,), dtype=tl.float32)
        nbad = tl.zeros((BLOCK_G,), dtype=tl.float32)
        for m0 in range(0, tl.max(n), BLOCK_M):
            in_group = (m0 + cols)[None, :] < n[:, None]
            x = _combined_rewards(r_ptr, start[:, None] + m0 + cols[None, :], in_group, stride_n, stride_k, w_ptr, K)
            cnt_c, mean_c, m2_c, nbad_c = _scaled_stats(x, in_group, scale, shift)
            nbad += nbad_c
            total = tl.maximum(cnt + cnt_c, 1.0)
            delta = mean_c - mean
            mean += delta * (cnt_c / total)
            m2 += m2_c + delta * delta * (cnt * cnt_c / total)
            cnt += cnt_c

    dof = cnt - correction
    std = tl.sqrt(tl.where(dof > 0, m2 / tl.maximum(dof, 1.0), 0.0))  # of the scaled rewards
    bad = nbad > 0
    valid = (~bad) & (std * scale > min_std)
    tl.store(mean_ptr + g, tl.where(bad, float("nan"), (mean + shift) * scale), mask=g_mask)
    tl.store(std_ptr + g, tl.where(bad, float("nan"), std * scale), mask=g_mask)
    tl.store(valid_ptr + g, valid, mask=g_mask)

    # Walk 2: write (r - mean) * factor, exactly 0 in invalid groups: (r - mean) / (std + eps) is
    # (r/s - mean/s) / (std/s + eps/s) in the scaled rewards; "batch" and "none" write r - mean.
    factor = tl.where(scale_mode == 0, 1.0 / (std + eps / scale), scale)
    if fits:
        a = ((x_tile / scale[:, None] - shift[:, None]) - mean[:, None]) * factor[:, None]
        tl.store(adv_ptr + start[:, None] + cols[None, :], tl.where(valid[:, None], a, 0.0), mask=in_tile)
    else:
        for m0 in range(0, tl.max(n), BLOCK_M):
            in_group = (m0 + cols)[None, :] < n[:, None]
            rows = start[:, None] + m0 + cols[None, :]
            x = _combined_rewards(r_ptr, rows, in_group, stride_n, stride_k, w_ptr, K)
            a = ((x / scale[:, None] - shift[:, None]) - mean[:, None]) * factor[:, None]
            tl.store(adv_ptr + rows, tl.where(valid[:, None], a, 0.0), mask=in_group)

    # invalid_fraction and the number of groups with a non-finite reward: integer counts (their sum does not
    # depend on the order the programs add them in), finished by the last program to take a ticket, which also
    # sets the counters back to zero for the next call on this stream.
    tl.atomic_add(counts_ptr + 1, tl.sum((valid & g_mask).to(tl.int32), axis=0), sem="relaxed")
    tl.atomic_add(counts_ptr + 2, tl.sum((bad & g_mask).to(tl.int32), axis=0), sem="relaxed")
    ticket = tl.atomic_add(counts_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        num_valid = tl.atomic_xchg(counts_ptr + 1, 0)
        tl.store(frac_ptr, 1.0 - num_valid.to(tl.float32) / num_groups)
        tl.store(nbad_ptr, tl.atomic_xchg(counts_ptr + 2, 0))
        tl.atomic_xchg(counts_ptr, 0)


# --------------------------------------------------------------------------------------------- launcher
def _block_shape(n: int, num_groups: int, group_size: int, has_offsets: bool) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_M): rows of twice the mean group size with offsets (so that most programs hold every one of
    their groups in one row and read the rewards once), of the group size without."""
    typical = 2 * -(-n // num_groups) if has_offsets else group_size
    block_m = min(max(triton.next_power_of_2(typical), 2), MAX_BLOCK_M)
    return max(TILE // block_m, 1), block_m


def _num_groups(rewards: torch.Tensor, group_offsets: torch.Tensor | None, group_size: int) -> int:
    return group_offsets.shape[0] - 1 if group_offsets is not None else rewards.shape[0] // group_size


def _batch_rescale(adv, mean, std, sizes, eps: float, correction: float) -> torch.Tensor:
    """Scale unscaled advantages by 1/(S + eps), S the std of all rewards of finite groups (Chan's formula)."""
    good = torch.isfinite(mean)  # fp64: std ** 2 of rewards beyond ~1e19 overflows fp32
    mean, std = mean.double(), std.double()
    n = torch.where(good, sizes.to(torch.float64), 0.0)
    m = torch.where(good, mean, 0.0)
    dof = sizes.to(torch.float64) - correction
    m2 = torch.where(good & (dof > 0), std.nan_to_num() ** 2 * dof, 0.0)
    count = n.sum()
    big_mean = (n * m).sum() / count.clamp(min=1.0)
    big_m2 = m2.sum() + (n * (m - big_mean) ** 2).sum()
    big_dof = count - correction
    big_std = torch.where(big_dof > 0, big_m2 / big_dof.clamp(min=1.0), 0.0).sqrt()
    # Invalid groups hold exact zeros and keep them: with eps = 0 and no valid group, S can be 0 and the
    # factor inf (0 * inf = NaN). A valid group has std > 0, so S > 0 whenever one exists.
    return torch.where(adv == 0, adv, (adv * (1.0 / (big_std + eps))).to(adv.dtype))


def _counters(device: torch.device) -> torch.Tensor:
    """The kernel's int32 [ticket, valid groups, bad groups] of the current stream (see _triton.stream_counters)."""
    return stream_counters("group_advantages", 3, device)


def group_advantages_triton(
    rewards: torch.Tensor,
    weights: torch.Tensor,
    group_offsets: torch.Tensor | None,
    group_size: int,
    scale: str,
    eps: float,
    unbiased: bool,
    min_std: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the Triton kernel. `rewards` [N, K] any strides, `weights` [K] fp32, offsets int32/int64 ->
    (advantages, valid, mean, std, invalid_fraction, number of groups with a non-finite reward (int32 0-d)).
    One launch ("batch" adds its few O(num_groups) ops)."""
    require_triton_device(_group_advantages_kernel, rewards)
    n = rewards.shape[0]
    num_groups = _num_groups(rewards, group_offsets, group_size)
    dev = rewards.device
    adv = torch.empty(n, dtype=torch.float32, device=dev)
    mean = torch.empty(num_groups, dtype=torch.float32, device=dev)
    std = torch.empty(num_groups, dtype=torch.float32, device=dev)
    valid = torch.empty(num_groups, dtype=torch.bool, device=dev)
    invalid_fraction = torch.empty((), dtype=torch.float32, device=dev)
    num_bad = torch.empty((), dtype=torch.int32, device=dev)
    has_offsets = group_offsets is not None
    block_g, block_m = _block_shape(n, num_groups, group_size, has_offsets)
    correction = 1.0 if unbiased else 0.0
    grid = (triton.cdiv(num_groups, block_g),)
    _group_advantages_kernel[grid](
        rewards, rewards.stride(0), rewards.stride(1), weights, rewards.shape[1],
        group_offsets if has_offsets else adv, max(group_size, 1), num_groups,
        adv, mean, std, valid, _counters(dev), invalid_fraction, num_bad,
        eps, correction, min_std, SCALE_MODES[scale],
        HAS_OFFSETS=has_offsets, BLOCK_G=block_g, BLOCK_M=block_m, num_warps=NUM_WARPS,
    )  # fmt: skip
    if scale == "batch":
        adv = _batch_rescale(adv, mean, std, group_sizes(n, group_size, group_offsets, dev), eps, correction)
    return adv, valid, mean, std, invalid_fraction, num_bad


# ----------------------------------------------------------------------------------------- registration
@torch.library.custom_op("grpo_kernels::group_advantages", mutates_args=(), device_types="cuda")
def group_advantages_op(
    rewards: torch.Tensor,
    weights: torch.Tensor,
    group_offsets: torch.Tensor | None,
    group_size: int,
    scale: str,
    eps: float,
    unbiased: bool,
    min_std: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return group_advantages_triton(rewards, weights, group_offsets, group_size, scale, eps, unbiased, min_std)[:5]


@group_advantages_op.register_kernel("cpu")
def _group_advantages_cpu(rewards, weights, group_offsets, group_size, scale, eps, unbiased, min_std):
    return _C.group_advantages(rewards, weights, group_offsets, group_size, scale, eps, unbiased, min_std)


@group_advantages_op.register_fake
def _group_advantages_fake(rewards, weights, group_offsets, group_size, scale, eps, unbiased, min_std):
    num_groups = _num_groups(rewards, group_offsets, group_size)
    f32 = dict(dtype=torch.float32, device=rewards.device)
    return (
        rewards.new_empty(rewards.shape[0], **f32),
        rewards.new_empty(num_groups, dtype=torch.bool),
        rewards.new_empty(num_groups, **f32),
        rewards.new_empty(num_groups, **f32),
        rewards.new_empty((), **f32),
    )


# ------------------------------------------------------------------------------------------------ autograd
def _setup_context(ctx, inputs, output):
    rewards, weights, group_offsets, group_size, scale, eps, unbiased, min_std = inputs
    _, valid, mean, std, invalid_fraction = output
    ctx.mark_non_differentiable(valid, invalid_fraction)
    ctx.save_for_backward(rewards, weights, group_offsets, valid, mean, std)
    ctx.group_size, ctx.scale, ctx.eps, ctx.correction = group_size, scale, eps, (1.0 if unbiased else 0.0)


def _backward(ctx, g_adv, g_valid, g_mean, g_std, g_frac):
    """Vector-Jacobian product in torch ops (rewards rarely need a gradient; this is exact, not fast).

    Per group with d_i = r_i - m, u = 1/(s + eps), v = valid, ds/dr_i = d_i / ((n - c) s):
      dr_i = v u (gA_i - mean_g gA) + gm / n + (gs - v u^2 sum_j gA_j d_j) ds/dr_i          ("group")
    "none" sets u = 1 and drops the u^2 term; "batch" uses the batch std S in u and adds
      - U^2 (sum_j v_j gA_j d_j) (r_i - M) / ((count - c) S)  over the members of finite groups.
    """
    rewards, weights, group_offsets, valid, mean, std = ctx.saved_tensors
    n_rows = rewards.shape[0]
    sizes = group_sizes(n_rows, ctx.group_size, group_offsets, rewards.device)
    num_groups = sizes.shape[0]
    seg = torch.repeat_interleave(torch.arange(num_groups, device=rewards.device), sizes, output_size=n_rows)

    def seg_sum(x):
        return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add(0, seg, x)

    zeros_g = torch.zeros(num_groups, dtype=torch.float32, device=rewards.device)
    g_adv = torch.zeros(n_rows, dtype=torch.float32, device=rewards.device) if g_adv is None else g_adv.float()
    g_mean = zeros_g if g_mean is None else g_mean.float()
    g_std = zeros_g if g_std is None else g_std.float()

    good_g = torch.isfinite(mean)
    good = good_g[seg]
    r_in = torch.where(good[:, None], rewards.float(), 0.0)
    r = (r_in * weights.float()).sum(dim=1)
    m = torch.where(good_g, mean, 0.0)
    s = torch.where(good_g, std, 0.0)
    d = torch.where(good, r - m[seg], 0.0)
    v = valid[seg].float()
    n_g = sizes.float()
    dof = n_g - ctx.correction
    ds_dr = torch.where((dof > 0) & (s > 0), 1.0 / (dof * s).clamp(min=1e-30), 0.0)[seg] * d
    centered_g = g_adv - (seg_sum(g_adv) / n_g)[seg]
    weighted = seg_sum(v * g_adv * d)

    if ctx.scale == "batch":
        count = good.float().sum()
        big_mean = r.sum() / count.clamp(min=1.0)
        dev_r = torch.where(good, r - big_mean, 0.0)
        big_dof = count - ctx.correction
        big_s = torch.where(big_dof > 0, (dev_r * dev_r).sum() / big_dof.clamp(min=1.0), 0.0).sqrt()
        big_u = 1.0 / (big_s + ctx.eps)
        g_r = v * big_u * centered_g
        dS = torch.where(big_s > 0, dev_r / (big_dof * big_s).clamp(min=1e-30), 0.0)
        g_r = g_r - big_u * big_u * weighted.sum() * dS
        gs_total = g_std
    elif ctx.scale == "group":
        u = 1.0 / (s + ctx.eps)
        g_r = v * u[seg] * centered_g
        gs_total = g_std - u * u * weighted
    else:
        g_r = v * centered_g
        gs_total = g_std
    g_r = g_r + (torch.where(good_g, g_mean, 0.0) / n_g)[seg] + torch.where(good_g, gs_total, 0.0)[seg] * ds_dr
    g_r = torch.where(good, g_r, 0.0)

    g_rewards = (g_r[:, None] * weights.float()).to(rewards.dtype) if ctx.needs_input_grad[0] else None
    g_weights = (g_r[:, None] * r_in).sum(dim=0).to(weights.dtype) if ctx.needs_input_grad[1] else None
    return g_rewards, g_weights, None, None, None, None, None, None


group_advantages_op.register_autograd(_backward, setup_context=_setup_context)


class TritonDirect(torch.autograd.Function):
    """The Triton launcher called outside the dispatcher, same autograd: CUDA tensors in eager calls (a custom op's
    Python dispatch costs tens of microseconds, more than the kernel at 4M rewards) and CPU tensors under
    TRITON_INTERPRET=1. Its sixth output is the number of groups with a non-finite reward (for nan="error")."""

    @staticmethod
    def forward(rewards, weights, group_offsets, group_size, scale, eps, unbiased, min_std):
        return group_advantages_triton(rewards, weights, group_offsets, group_size, scale, eps, unbiased, min_std)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output[:5])
        ctx.mark_non_differentiable(output[5])

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, *grads[:5])


# ------------------------------------------------------------------------------------------- the one entry
def group_advantages(rewards, weights, group_offsets, group_size, scale, eps, unbiased, min_std, impl):
    """What the public function runs on checked inputs -> (advantages, valid, mean, std, invalid_fraction, number
    of groups with a non-finite reward or None): the Triton launcher directly (CUDA outside torch.compile, or
    impl="triton" on CPU tensors: the interpreter), else the registered op (C++ on CPU, and what torch.compile
    traces)."""
    args = (rewards, weights, group_offsets, group_size, scale, eps, unbiased, min_std)
    direct = rewards.device.type == "cuda" or impl == "triton"
    if direct and impl != "cpp" and not torch.compiler.is_compiling():
        return TritonDirect.apply(*args)
    return (*torch.ops.grpo_kernels.group_advantages(*args), None)
