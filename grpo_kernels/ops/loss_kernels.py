"""The Triton kernels of the GRPO policy loss; the design, the per-sequence stats they write and the behaviour on
non-finite values are in grpo_kernels/ops/loss.py (launchers, registration, autograd)."""

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
LOG_1E_8 = tl.constexpr(-18.420680743952367)  # VESPO's floor on log ratios (TRL: log(1e-8))
NUM_SEQ_SUMS = 5  # per (sequence, chunk) sums of the first pass
_SEQ_SUMS = tl.constexpr(NUM_SEQ_SUMS)


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _min(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)  # NaN in, NaN out, as torch.min / clamp


@triton.jit
def _max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _times_w(x, w):
    """x w, and 0 where x == 0 even for w = inf: a ratio beyond fp32 (log w > 88.72) times an exact zero (a
    clipped branch, a zero advantage or derivative) is 0, as in exact arithmetic, not NaN."""
    return tl.where(x == 0.0, 0.0, x * w)


@triton.jit
def _program_span(cu_ptr, row_len, num_chunks, PADDED: tl.constexpr, CHUNK: tl.constexpr):
    """(sequence, first token, the sequence's end) of this program's chunk: sequence s is the row [s row_len,
    (s + 1) row_len) with PADDED, else tokens cu_seqlens[s] .. cu_seqlens[s + 1]."""
    pid = tl.program_id(0).to(tl.int64)
    seq = pid // num_chunks
    if PADDED:
        start = seq * row_len
        end = start + row_len
    else:
        start = tl.load(cu_ptr + seq).to(tl.int64)
        end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    return seq, start + (pid % num_chunks) * CHUNK, end


@triton.jit
def _sampler_weight(diff, cap, truncate):
    """exp(nan_to_num(diff)), truncated at cap or zeroed above it (TRL's vLLM importance-sampling modes)."""
    diff = tl.where(diff != diff, 0.0, tl.minimum(tl.maximum(diff, -FLT_MAX), FLT_MAX))
    r = tl.exp(diff)
    return tl.where(truncate != 0, tl.minimum(r, cap), tl.where(r > cap, 0.0, r))


@triton.jit
def grpo_seq_stats_kernel(
    logp_ptr, old_ptr, sampler_ptr, mask_ptr, cu_ptr, partial_ptr, num_chunks, sampler_cap, sampler_truncate,
    HAS_OLD: tl.constexpr, HAS_SAMPLER: tl.constexpr, HAS_MASK: tl.constexpr, VESPO: tl.constexpr,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Per (sequence, chunk): sum m (logp - old), sum m, sum nan_to_num(m (old - sampler)), and for VESPO
    sum m clamp(logp - old, -20, 20) and, over every position, sum clamp(log r, log 1e-8, 20) of the token sampler
    weight r (NaN propagates, as torch.clamp)."""
    pid = tl.program_id(0).to(tl.int64)
    seq = pid // num_chunks
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    chunk_start = start + (pid % num_chunks) * CHUNK
    acc_lr = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_n = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_is = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_v = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_vis = tl.zeros((BLOCK,), dtype=tl.float32)
    if VESPO and HAS_SAMPLER:
        log_cap = tl.log(sampler_cap)
    for i in range(0, CHUNK, BLOCK):
        offs = chunk_start + i + tl.arange(0, BLOCK)
        inb = offs < end
        m = tl.load(mask_ptr + offs, mask=inb, other=0.0) if HAS_MASK else tl.where(inb, 1.0, 0.0)
        lp = tl.load(logp_ptr + offs, mask=inb, other=0.0).to(tl.float32)
        old = tl.load(old_ptr + offs, mask=inb, other=0.0) if HAS_OLD else lp
        on = m != 0.0
        acc_lr += tl.where(on, (lp - old) * m, 0.0)
        acc_n += m
        if HAS_SAMPLER:
            d = (old - tl.load(sampler_ptr + offs, mask=inb, other=0.0)) * m
            d = tl.where(d != d, 0.0, tl.minimum(tl.maximum(d, -FLT_MAX), FLT_MAX))
            acc_is += tl.where(inb, d, 0.0)
            if VESPO:  # log f(d): min(d, log cap) truncated, or d / -inf (floored) above the cap with a mask
                over = tl.exp(d) > sampler_cap
                log_r = tl.where(sampler_truncate != 0, tl.minimum(d, log_cap), tl.where(over, LOG_1E_8, d))
                acc_vis += tl.where(inb, tl.minimum(tl.maximum(log_r, LOG_1E_8), 20.0), 0.0)
        if VESPO:
            acc_v += tl.where(on, _min(_max(lp - old, -20.0), 20.0) * m, 0.0)
    out = partial_ptr + pid * _SEQ_SUMS
    tl.store(out, tl.sum(acc_lr, axis=0))
    tl.store(out + 1, tl.sum(acc_n, axis=0))
    tl.store(out + 2, tl.sum(acc_is, axis=0))
    tl.store(out + 3, tl.sum(acc_v, axis=0))
    tl.store(out + 4, tl.sum(acc_vis, axis=0))


@triton.jit(noinline=True)  # its own register allocation: inlined, ptxas spilled the padded kernels on Triton 3.6
def _finish_loss(
    partial_ptr, cu_ptr, row_len, num_seqs, num_chunks, loss_ptr, metrics_ptr, scale_ptr, num_items_ptr, div_kind,
    div_value, PADDED: tl.constexpr,
):  # fmt: skip
    """One program's pass over the [num_seqs, num_chunks, 9] fp64 partials, in a fixed order (deterministic):
    loss_ptr <- the loss with its normalizer, metrics_ptr[0:6] <- the clip low / high / region, ratio, KL and sampler
    columns over max(sum m, 1), scale_ptr <- d loss / d (sum_t m l) of each sequence (div_kind 0) or of all (else).
    div_kind: 0 mean over sequences of each one's sum / max(its sum m, 1) (grpo, sapo); 1 sum / div_value (luspo:
    B; dr_grpo: B max_completion_length; dapo / cispo: max(num_items_in_batch, 1)); 2 sum / max(sum m, 1); 3 sum /
    (B longest sequence) (dr_grpo); 4 sum / max(num_items_ptr[0], 1), NaN where that value is <= 0 (a device
    tensor's value, never read on the host)."""
    cols = tl.arange(0, 16)
    totals = tl.zeros((16,), dtype=tl.float64)
    seq_means = tl.zeros((64,), dtype=tl.float64)
    longest = tl.zeros((64,), dtype=tl.int64)
    for s0 in range(0, num_seqs, 64):
        seqs = s0 + tl.arange(0, 64).to(tl.int64)
        ok = seqs < num_seqs
        tile = tl.zeros((64, 16), dtype=tl.float64)
        for c in range(0, num_chunks):
            ptrs = partial_ptr + (seqs[:, None] * num_chunks + c) * 9 + cols[None, :]
            tile += tl.load(ptrs, mask=ok[:, None] & (cols[None, :] < 9), other=0.0, cache_modifier=".cg")
        totals += tl.sum(tile, axis=0)
        n_s = _max(tl.sum(tl.where(cols[None, :] == 1, tile, 0.0), axis=1), 1.0)  # NaN (a NaN mask) stays NaN
        seq_means += tl.where(ok, tl.sum(tl.where(cols[None, :] == 0, tile, 0.0), axis=1) / n_s, 0.0)
        if div_kind == 0:
            tl.store(scale_ptr + seqs, (1.0 / (n_s * num_seqs)).to(tl.float32), mask=ok)
        if not PADDED:
            lo = tl.load(cu_ptr + seqs, mask=ok, other=0).to(tl.int64)
            hi = tl.load(cu_ptr + seqs + 1, mask=ok, other=0).to(tl.int64)
            longest = tl.maximum(longest, hi - lo)
    tokens = _max(tl.sum(tl.where(cols == 1, totals, 0.0), axis=0), 1.0)
    loss_sum = tl.sum(tl.where(cols == 0, totals, 0.0), axis=0)
    if PADDED:
        max_len = tl.cast(row_len, tl.float64)  # (tl.cast: row_len arrives as a constexpr when it is 1)
    else:
        max_len = tl.max(longest, axis=0).to(tl.float64)
    divisor = tl.cast(div_value, tl.float64)
    if div_kind == 2:
        divisor = tokens
    elif div_kind == 3:
        divisor = max_len * num_seqs
    elif div_kind == 4:
        items = tl.load(num_items_ptr).to(tl.float64)
        divisor = tl.where(items > 0.0, tl.maximum(items, 1.0), float("nan"))
    if div_kind == 0:
        loss = tl.sum(seq_means, axis=0) / num_seqs
    else:
        loss = loss_sum / divisor
        tl.store(scale_ptr, (1.0 / divisor).to(tl.float32))
    tl.store(loss_ptr, loss.to(tl.float32))
    tl.store(metrics_ptr + cols - 3, (totals / tokens).to(tl.float32), mask=(cols >= 3) & (cols < 9))


@triton.jit
def grpo_loss_fwd_kernel(
    logp_ptr, old_ptr, ref_ptr, sampler_ptr, adv_ptr, mask_ptr, cu_ptr, seq_logw_ptr, seq_is_ptr, seq_phi_ptr,
    coef_ptr, partial_ptr, num_chunks,
    eps_low, eps_high, delta, beta, bias_kl, sampler_cap, sampler_truncate, sampler_per_seq, tau_pos, tau_neg,
    row_len, counter_ptr, loss_ptr, metrics_ptr, scale_ptr, num_items_ptr, num_seqs, div_kind, div_value,
    LOSS: tl.constexpr, SEQ_LEVEL: tl.constexpr, HAS_OLD: tl.constexpr, HAS_KL: tl.constexpr,
    HAS_SAMPLER: tl.constexpr, HAS_MASK: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, PADDED: tl.constexpr,
    FINISH: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Per (sequence, chunk): coef_t and the partial sums (see ops/loss.py). PADDED: sequence s is the row
    [s row_len, (s + 1) row_len) (no cu_seqlens read). FINISH: the last program to finish also reduces every
    partial into the loss, the metrics and the backward's factors (_finish_loss); the other arguments after
    tau_neg are read only then. Inputs other than logps are read in any float (mask: any) dtype, as fp32."""
    seq, chunk_start, end = _program_span(cu_ptr, row_len, num_chunks, PADDED, CHUNK)
    if SEQ_LEVEL:
        seq_logw = tl.load(seq_logw_ptr + seq)
    if HAS_SAMPLER:
        seq_is = 1.0
        if sampler_per_seq != 0:
            seq_is = tl.load(seq_is_ptr + seq)
    if LOSS == 3:
        phi_pos = tl.load(seq_phi_ptr + 2 * seq)
        phi_neg = tl.load(seq_phi_ptr + 2 * seq + 1)
    if not ADV_PER_TOKEN:
        seq_adv = tl.load(adv_ptr + seq).to(tl.float32)
    if HAS_KL:
        log_beta = tl.log(beta)
    # The value sums (loss, dl/dw, ratio, KL, sampler diff) in fp64: a chunk's sum of finite fp32 terms may pass
    # FLT_MAX where the mean the loss takes of it does not. Each block's terms are summed in fp64 into one fp64
    # value per sum ([1]): five BLOCK-wide fp64 accumulators live across the loop spilled registers on sm_90a
    # (Triton 3.6, cispo with every input). The counts stay BLOCK-wide fp32 (exact to 2^24 per chunk).
    acc_loss = tl.zeros((1,), dtype=tl.float64)
    acc_n = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_dw = tl.zeros((1,), dtype=tl.float64)
    acc_low = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_high = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_region = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_ratio = tl.zeros((1,), dtype=tl.float64)
    acc_kl = tl.zeros((1,), dtype=tl.float64)
    acc_diff = tl.zeros((1,), dtype=tl.float64)
    for i in range(0, CHUNK, BLOCK):
        offs = chunk_start + i + tl.arange(0, BLOCK)
        inb = offs < end
        m = tl.load(mask_ptr + offs, mask=inb, other=0).to(tl.float32) if HAS_MASK else tl.where(inb, 1.0, 0.0)
        on = m != 0.0
        lp = tl.load(logp_ptr + offs, mask=inb, other=0.0).to(tl.float32)
        old = tl.load(old_ptr + offs, mask=inb, other=0.0).to(tl.float32) if HAS_OLD else lp
        # (a scalar advantage is broadcast to the block: the interpreter cannot `&` a scalar and a block mask)
        if ADV_PER_TOKEN:
            adv = tl.load(adv_ptr + offs, mask=inb, other=0.0).to(tl.float32)
        else:
            adv = seq_adv + tl.zeros_like(lp)
        log_w = seq_logw + tl.zeros_like(lp) if SEQ_LEVEL else lp - old
        w = tl.exp(log_w)  # +inf above log w = 88.72: see _times_w
        # The policy term l = pol(w), its derivative in w, and its direct derivative in logp. min / clamp propagate
        # NaN, as torch's do.
        if LOSS == 0:  # grpo / bnpo / dr_grpo / dapo: -min(min(w, delta) A, clip(w) A), ties split as torch.min
            w_m = _min(w, delta)
            clipped = _min(_max(w, 1.0 - eps_low), 1.0 + eps_high)
            a1 = _times_w(adv, w_m)
            a2 = clipped * adv
            pol = -_min(a1, a2)
            g1 = tl.where(w <= delta, -adv, 0.0)
            g2 = tl.where((w >= 1.0 - eps_low) & (w <= 1.0 + eps_high), -adv, 0.0)
            dpol_dw = tl.where(a1 < a2, g1, tl.where(a1 > a2, g2, 0.5 * (g1 + g2)))
            direct = tl.zeros_like(lp)
            low = (w_m < 1.0 - eps_low) & (adv < 0.0)
            high = (w_m > 1.0 + eps_high) & (adv > 0.0)
        elif LOSS == 1:  # cispo: -stopgrad(min(w, eps_high)) A logp
            cw = _min(w, eps_high)
            pol = -cw * adv * lp
            dpol_dw = tl.zeros_like(lp)
            direct = -cw * adv
            low = (w > eps_high) & (adv > 0.0)
            high = low & (adv < 0.0)  # never: cispo reports one clip fraction, in the "low" column
        elif LOSS == 2:  # sapo: -(4 / tau) sigmoid(tau (w - 1)) A, tau by the sign of A
            tau = tl.where(adv > 0.0, tau_pos, tau_neg)
            z = tau * (w - 1.0)
            # sigmoid(z) and sigmoid(-z) from one exp(-|z|): the gate's derivative sg (1 - sg) keeps its
            # relative precision when sg rounds to 1, and is exactly 0 (not 0 * inf) for w = inf.
            e = tl.exp(-tl.abs(z))
            inv = 1.0 / (1.0 + e)
            sg = tl.where(z >= 0.0, inv, e * inv)
            sg_c = tl.where(z >= 0.0, e * inv, inv)
            pol = -sg * 4.0 / tau * adv
            dpol_dw = -4.0 * adv * sg * sg_c
            direct = tl.zeros_like(lp)
            low = (w < 1.0 - eps_low) & (adv < 0.0)
            high = (w > 1.0 + eps_high) & (adv > 0.0)
        else:  # vespo: -phi A logp, phi the sequence's detached gamma weight for the sign of A (NaN A: A < 0)
            phi = tl.where(adv >= 0.0, phi_pos, phi_neg)
            pol = -phi * adv * lp
            dpol_dw = tl.zeros_like(lp)
            direct = -phi * adv
        if HAS_SAMPLER:
            sampler = tl.load(sampler_ptr + offs, mask=inb, other=0.0).to(tl.float32)
            if LOSS != 3:  # vespo's sampler weights are in phi
                r_tok = _sampler_weight((old - sampler) * m, sampler_cap, sampler_truncate)
                r = tl.where(sampler_per_seq != 0, seq_is, r_tok)
                pol = tl.where((r == 0.0) & (pol == pol), 0.0, pol * r)  # a zeroed token adds 0, even if pol = inf
                dpol_dw = dpol_dw * r
                direct = direct * r
            diff = tl.abs(lp - sampler)
            acc_diff += tl.sum(tl.where(on & (diff == diff), m * tl.minimum(diff, FLT_MAX), 0.0).to(tl.float64),
                               axis=0)  # nan_to_num
        if HAS_KL:  # beta k3 k, k3 = exp(ref - logp) - (ref - logp) - 1, k = w with the bias correction, else 1
            dr = tl.load(ref_ptr + offs, mask=inb, other=0.0).to(tl.float32) - lp
            # beta exp(dr) and beta exp(dr) w as single exps: finite wherever the products are, even when
            # exp(dr) alone overflows (a token the policy has all but ruled out).
            be = tl.exp(dr + log_beta)
            bew = tl.exp(dr + log_w + log_beta)
            fin = w != float("inf")  # (a NaN w takes the finite branch: NaN, as the reference's k3 w)
            if bias_kl != 0:
                # For w = inf the term is inf (k3 > 0), or 0 where dr = 0 (k3 = 0): _times_w(dr * dr, w).
                kl_term = tl.where(fin, bew - beta * (dr + 1.0) * w, _times_w(dr * dr, w))
                if SEQ_LEVEL:  # d/dlogp with w_s fixed: beta (1 - e) w_s;  d/dw_s: beta k3
                    direct = direct + tl.where(fin, beta * w - bew, _times_w(beta - be, w))
                    dpol_dw = dpol_dw + be - beta * (dr + 1.0)
                else:  # the whole derivative of beta k3 w in logp, -beta dr w (no exp(dr) cancellation), joins the
                    # policy's dl/dw before the one product with w: for w = inf an unclipped -A and -beta dr of
                    # opposite signs give the sign of their sum, not inf - inf = NaN
                    dpol_dw = dpol_dw - beta * dr
            else:
                kl_term = be - beta * (dr + 1.0)
                direct = direct + (beta - be)
            pol = pol + kl_term
            acc_kl += tl.sum(tl.where(on, m * (kl_term / beta), 0.0).to(tl.float64), axis=0)
        if SEQ_LEVEL:
            coef = m * direct
            acc_dw += tl.sum(tl.where(on, m * dpol_dw, 0.0).to(tl.float64), axis=0)
        else:
            coef = m * (_times_w(dpol_dw, w) + direct)
        if LOSS != 3:  # a NaN loss term has a NaN gradient (vespo's -phi A is its gradient even for a NaN logp) ...
            coef = tl.where(pol != pol, pol, coef)
        elif HAS_KL:  # ... but not its KL term's (a NaN w times dr = 0 in d/dlogp)
            coef = tl.where(kl_term != kl_term, kl_term, coef)
        coef = tl.where(on, coef, 0.0)
        tl.store(coef_ptr + offs, coef, mask=inb)
        acc_loss += tl.sum(tl.where(on, m * pol, 0.0).to(tl.float64), axis=0)
        acc_n += m
        if LOSS == 3:
            acc_low += tl.where(on, m * phi, 0.0)
        else:
            acc_low += tl.where(on & low, m, 0.0)
            acc_high += tl.where(on & high, m, 0.0)
            acc_region += tl.where(on & (low | high), m, 0.0)
        acc_ratio += tl.sum(tl.where(on, m * w, 0.0).to(tl.float64), axis=0)
    out = partial_ptr + tl.program_id(0).to(tl.int64) * 9  # fp64
    tl.store(out, tl.sum(acc_loss, axis=0))
    tl.store(out + 1, tl.sum(acc_n, axis=0).to(tl.float64))
    tl.store(out + 2, tl.sum(acc_dw, axis=0))
    tl.store(out + 3, tl.sum(acc_low, axis=0).to(tl.float64))
    tl.store(out + 4, tl.sum(acc_high, axis=0).to(tl.float64))
    tl.store(out + 5, tl.sum(acc_region, axis=0).to(tl.float64))
    tl.store(out + 6, tl.sum(acc_ratio, axis=0))
    tl.store(out + 7, tl.sum(acc_kl, axis=0))
    tl.store(out + 8, tl.sum(acc_diff, axis=0))
    if FINISH:  # the last program to get here (an integer ticket: the order of the sums does not depend on it)
        tl.debug_barrier()  # every thread's partial stores come before the ticket (release), ...
        ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) - 1:  # ... and the last program's loads after it (acquire)
            _finish_loss(partial_ptr, cu_ptr, row_len, num_seqs, num_chunks, loss_ptr, metrics_ptr, scale_ptr,
                         num_items_ptr, div_kind, div_value, PADDED)
            tl.atomic_xchg(counter_ptr, 0)  # ready for the next call on this stream, with no memset launch




@triton.jit
def grpo_loss_bwd_kernel(
    a_ptr, b_ptr, coef_ptr, mask_ptr, cu_ptr, grad_ptr, num_chunks, a_stride, g_ptr, row_len,
    SEQ_LEVEL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_G: tl.constexpr, PADDED: tl.constexpr,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """grad_t = a_s coef_t (+ b_s m_t for GSPO, 0 where m_t = 0), a_s = a[s a_stride] (times the upstream gradient
    g_ptr[0] with HAS_G: read on the device, so a backward needs no host value); PADDED as in the forward."""
    seq, chunk_start, end = _program_span(cu_ptr, row_len, num_chunks, PADDED, CHUNK)
    a = tl.load(a_ptr + seq * a_stride)
    if HAS_G:
        a = a * tl.load(g_ptr).to(tl.float32)
    if SEQ_LEVEL:
        b = tl.load(b_ptr + seq)
    for i in range(0, CHUNK, BLOCK):
        offs = chunk_start + i + tl.arange(0, BLOCK)
        inb = offs < end
        g = a * tl.load(coef_ptr + offs, mask=inb, other=0.0)
        if SEQ_LEVEL:
            if HAS_MASK:
                m = tl.load(mask_ptr + offs, mask=inb, other=0.0)
                g += tl.where(m != 0.0, b * m, 0.0)  # 0 for a masked token even where b is NaN
            else:
                g += b
        tl.store(grad_ptr + offs, g.to(grad_ptr.dtype.element_ty), mask=inb)
