"""The long-chain benchmark's quick path: every provider measured in its own process on the tiny model, the rows,
the memory model and the plot written; a provider over the memory cap is recorded, not fatal."""

import csv
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "long_chains" / "sweep.py"


def _run(tmp_path, *extra):
    """(rows, stdout, stderr) of a quick sweep; a failed measurement's account (diagnose.report) is in stderr."""
    out = tmp_path / "rows.csv"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--csv", str(out), *extra], capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with out.open() as f:
        return list(csv.DictReader(f)), proc.stdout, proc.stderr


def _accounts(stderr: str) -> str:
    """The failed measurements' accounts in a sweep's stderr (diagnose.report: what CI shows of a failed row)."""
    from benchmarks.long_chains.diagnose import HEADING

    at = stderr.find(HEADING)
    return stderr[at : at + 12000] if at >= 0 else f"no account in the sweep's stderr, which ends: {stderr[-2000:]}"


@pytest.mark.slow
def test_quick_long_chains_measures_every_provider_and_writes_the_report(tmp_path):
    # three of the six providers (the others are the same code with a flag flipped), to keep the suite short
    rows, stdout, stderr = _run(tmp_path, "--providers", "trl_ckpt,gk_blocks,gk_sp")
    assert [(r["sweep"], r["provider"]) for r in rows] == [(s, p) for s in ("spread", "length")
                                                           for p in ("trl_ckpt", "gk_blocks", "gk_sp")]  # fmt: skip
    by = {r["provider"]: r for r in rows if r["sweep"] == "spread"}
    failed = [(r["provider"], r["sweep"], r["status"]) for r in rows if r["status"] != "ok"]
    if failed:  # the statuses, then the accounts in full (each rank's phases and stderr, who sent a signal)
        pytest.fail(f"{failed}\n{_accounts(stderr)}")
    for r in rows:
        assert float(r["peak_rss_mb"]) >= float(r["base_rss_mb"]) > 100 and float(r["step_s"]) > 0
    # TRL pads every completion to the longest (16..128 tokens drawn): a real share of its tokens is padding; the
    # packed step computes none (SP rounds the row to a multiple of 2: at most one pad token)
    assert float(by["trl_ckpt"]["padding_fraction"]) > 0.1
    assert float(by["gk_blocks"]["padding_fraction"]) == 0.0
    assert int(by["gk_sp"]["sp"]) == 2  # the tiny model's 4 heads: the smallest N that divides them
    assert int(by["gk_sp"]["computed_tokens"]) - int(by["gk_blocks"]["computed_tokens"]) in (0, 1)
    assert int(by["trl_ckpt"]["real_tokens"]) == int(by["gk_blocks"]["real_tokens"])  # the same step
    model = (tmp_path / "memory_model.md").read_text()
    assert "extrapolation, not a measurement" in model
    assert all(f"| {p} |" in model for p in ("trl_ckpt", "gk_blocks", "gk_sp"))
    assert (tmp_path / "rows.png").stat().st_size > 1000
    assert "| spread | 4 | 16-128 | gk_sp | ok |" in stdout
    # resumable: a rerun measures nothing new
    again, _, _ = _run(tmp_path, "--providers", "trl_ckpt,gk_blocks,gk_sp")
    assert len(again) == len(rows)


@pytest.mark.slow
def test_a_provider_over_the_memory_cap_is_recorded_not_fatal(tmp_path):
    rows, _, stderr = _run(tmp_path, "--cap-gb", "0.2", "--providers", "gk_blocks")
    if [r["status"] for r in rows] != ["over_cap", "over_cap"]:  # both quick points
        pytest.fail(f"{[r['status'] for r in rows]}\n{_accounts(stderr)}")


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failed_rank_is_named_by_its_own_error_not_by_torchrun(tmp_path, how):
    # a real torchrun whose rank 1 raises or is SIGKILLed (as the kernel's OOM killer would): the row's status must say
    # what happened to the rank, not only torchrun's "ChildFailedError" (all a failed row said before)
    from benchmarks.long_chains.sweep import failure_reason

    script = tmp_path / "rank.py"
    script.write_text("import os, signal\nif os.environ['RANK'] == '1':\n"
                      "    if os.environ['HOW'] == 'kill':\n        os.kill(os.getpid(), signal.SIGKILL)\n"
                      "    raise ValueError('rank one broke')\n")  # fmt: skip
    env = {**os.environ, "HOW": how}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           str(script)], capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "ChildFailedError" in proc.stderr
    reason = failure_reason(proc.returncode, proc.stderr)
    expected = {"raise": "ValueError: rank one broke; a rank's exit code 1",
                "kill": "a rank's exit code -9 (Signal 9 (SIGKILL))"}  # fmt: skip
    assert reason == expected[how], reason
    assert failure_reason(-9, "") == "no output; killed by signal 9"
    both = ("Failures:\n[1]:\n  exitcode  : -15 (pid: 2)\n  traceback : Signal 15 (SIGTERM) received by PID 2\n"
            "Root Cause (first observed failure):\n[0]:\n  exitcode  : -9 (pid: 1)\n"
            "  traceback : Signal 9 (SIGKILL) received by PID 1\n")  # torchrun's summary when two ranks failed
    assert failure_reason(1, both) == "a rank's exit code -9 (Signal 9 (SIGKILL))"


def test_component_model_splits_the_fitted_slopes_and_scales_them_to_the_big_models():
    """The offload / tiled-MLP model: gk_blocks - gk_tiled is the MLP's share, gk_tiled - the checkpoint floor the
    rest of a block's working set; rows below the component fit's minimum (a flat start) are left out."""
    from benchmarks.long_chains.report import COMPONENT_MIN_TOKENS, component_model

    floor, rest, mlp = 30 * 576 * 4, 6 * 576 * 4, 7 * 1536 * 4  # SmolLM2: 6 hidden- and 7 intermediate-size floats
    row = dict(status="ok", sweep="length")
    rows = [dict(row, provider=p, computed_tokens=str(n), peak_rss_mb=str(2000 + n * slope / 2**20))
            for p, slope in (("gk_blocks", floor + rest + mlp), ("gk_tiled", floor + rest))
            for n in (COMPONENT_MIN_TOKENS, 2 * COMPONENT_MIN_TOKENS, 4 * COMPONENT_MIN_TOKENS)]  # fmt: skip
    rows += [dict(row, provider=p, computed_tokens="1000", peak_rss_mb="9999") for p in ("gk_blocks", "gk_tiled")]
    text = "\n".join(component_model(rows, dict(layers=30, hidden=576, intermediate=1536)))
    assert "removes 7.00 x intermediate size floats" in text and "is 6.00 x hidden size floats" in text
    # Llama-8B bf16 per token: offload + tiled = rest only (6 x 4096 x 2); tiled adds the floor (32 x 4096 x 2);
    # blocks adds the MLP's 7 x 14336 x 2 too
    assert "| Llama-8B | offload + tiled MLP | 49 kB |" in text and "3.7M (8 GPUs) |" in text
    assert "| Llama-8B | blocks + tiled MLP | 311 kB |" in text and "| Llama-8B | blocks | 512 kB |" in text
    assert "No gk_blocks" in component_model(rows[:3], dict(layers=30, hidden=576, intermediate=1536))[0]


def test_pairs_report_takes_each_ratio_within_one_repeat_then_the_median_and_range_over_repeats(tmp_path):
    """long_chains_pairs_<model>.md: ours / TRL and ours / trl_rowfold per (length, repeat), from the repeat's own
    rows only; a provider missing from a repeat leaves its ratios out (a dash), not filled from another run."""
    from benchmarks.long_chains.report import COLUMNS_PAIRS, pairs_report
    from benchmarks.long_chains.sweep import COLUMNS

    assert set(COLUMNS_PAIRS) <= set(COLUMNS)  # what it reads, the benchmark writes
    def write(rep, rows):
        with (tmp_path / f"long_chains_pairs_rep{rep}_m.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS_PAIRS)
            w.writeheader()
            for provider, length, step_s in rows:  # peaks: 1000 MB + 0.1 / 0.2 MB per token computed
                tokens = 8 * length
                peak = 1000 + tokens * (0.2 if provider == "trl_ckpt" else 0.1)
                w.writerow(dict(provider=provider, sweep="length", min_len=length, max_len=length, step_s=step_s,
                                peak_rss_mb=peak, computed_tokens=tokens, status="ok", load_before=0.9, device="cpu",
                                timestamp="2026-12-05T10:00:00"))  # fmt: skip

    write(1, [("trl_ckpt", 2000, 100), ("trl_rowfold", 2000, 80), ("gk_blocks", 2000, 60), ("gk_auto", 2000, 40),
              ("trl_ckpt", 4000, 300), ("gk_blocks", 4000, 150)])  # fmt: skip
    write(2, [("trl_ckpt", 2000, 200), ("trl_rowfold", 2000, 100), ("gk_blocks", 2000, 90), ("gk_auto", 2000, 90)])
    write(3, [("trl_ckpt", 2000, 50), ("trl_rowfold", 2000, 50), ("gk_blocks", 2000, 40), ("gk_auto", 2000, 45)])
    text = pairs_report(tmp_path, "m").read_text()
    assert "| 2000 | 1 | cpu | 2026-12-05 10:00 | 0.90 | 100.0 | 80.0 | 60.0 | 40.0 | 0.60x | 0.75x | 0.40x | 0.50x |" \
        in text
    assert "| 4000 | 1 | cpu | 2026-12-05 10:00 | 0.90 | 300.0 | - | 150.0 | - | 0.50x | - | - | - |" in text
    # blocks / TRL over the repeats: 0.60, 0.45, 0.80 -> median 0.60; blocks / rowfold: 0.75, 0.90, 0.80
    assert "| 2000 | 3 | 0.60x (0.45-0.80) | 0.80x (0.75-0.90) | 0.45x (0.40-0.90) | 0.90x (0.50-0.90) |" in text
    assert "| 4000 | 1 | 0.50x | - | - | - |" in text
    # peaks fitted over every L and repeat: 0.2 MB = 209.7 kB per token for TRL (4 rows), 0.1 MB for gk_blocks
    assert "| trl_ckpt | 209.7 | 1000 | 4 |" in text and "| gk_blocks | 104.9 | 1000 | 4 |" in text


def test_the_floor_bound_is_the_static_memory_plus_the_checkpointed_inputs_against_trls_peak():
    from benchmarks.long_chains.report import floor_bound

    point = dict(status="ok", sweep="length", group_size="8", min_len="4000", max_len="4000")
    tokens = 1500  # 30 x 576 fp32 per token: ~99 MB of block inputs
    rows = [dict(point, provider="trl_ckpt", peak_rss_mb="1000", base_rss_mb="600", computed_tokens="99"),
            dict(point, provider="gk_tiled", peak_rss_mb="800", base_rss_mb="600", computed_tokens=str(tokens)),
            dict(point, provider="gk_tiled", min_len="2000", max_len="2000", peak_rss_mb="1", base_rss_mb="1",
                 computed_tokens="1")]  # fmt: skip
    floor = tokens * 30 * 576 * 4 / 2**20
    text = "\n".join(floor_bound(rows, dict(layers=30, hidden=576, intermediate=1536)))
    assert "ours with the tiled MLP at 800 MB (0.80x)" in text
    assert f"{floor:.0f} MB are the checkpointed block inputs of its {tokens} tokens" in text
    assert f"{600 + floor:.0f} MB, {(600 + floor) / 1000:.2f}x TRL's peak" in text
    assert f"the working set above them is {200 - floor:.0f} MB" in text
    assert floor_bound(rows[1:], dict(layers=30, hidden=576, intermediate=1536)) == []  # no TRL row: nothing
    rowfold = dict(point, provider="trl_rowfold", peak_rss_mb="640", base_rss_mb="600", computed_tokens="99")
    text = "\n".join(floor_bound([*rows, rowfold], dict(layers=30, hidden=576, intermediate=1536)))
    assert "(0.80x); TRL without its CPU fold peaks at 640 MB (ours 1.25x of it). Of ours, 600 MB" in text


def test_the_memory_model_fits_trl_without_its_fold_from_the_pairs_runs_beside_the_main_csv(tmp_path):
    """report() of the main CSV adds the trl_rowfold rows of the pairs CSVs in its directory (and only those) to the
    memory model: a fitted row of its own and the note on which TRL row to set beside ours."""
    from benchmarks.long_chains.report import report
    from benchmarks.long_chains.sweep import COLUMNS

    def write(path, rows):
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
            w.writeheader()
            for provider, length, peak in rows:
                w.writerow(dict(provider=provider, sweep="length", status="ok", model="smollm2-135m", group_size=8,
                                min_len=length, max_len=length, computed_tokens=8 * length, peak_rss_mb=peak,
                                cap_mb=12288))  # fmt: skip

    write(tmp_path / "main.csv", [("trl_ckpt", 1000, 3000), ("trl_ckpt", 2000, 4000), ("gk_blocks", 1000, 2000),
                                  ("gk_blocks", 2000, 2500)])  # fmt: skip
    # rowfold: 1000 MB + 0.05 MB (52.4 kB) per token; blocks: 1500 + 0.0625 MB; the pairs' gk_blocks rows stay out
    write(tmp_path / "long_chains_pairs_rep1_smollm2-135m.csv",
          [("trl_rowfold", 1000, 1400), ("trl_rowfold", 2000, 1800), ("gk_blocks", 1000, 9000),
           ("gk_blocks", 2000, 99999)])  # fmt: skip
    report(tmp_path / "main.csv")
    model = (tmp_path / "memory_model.md").read_text()
    assert "| trl_rowfold | 52.4 kB | 1000 |" in model and "| gk_blocks | 65.5 kB | 1500 |" in model
    assert "trl_rowfold is TRL with that fold run 128 rows at a time" in model


def test_longest_search_doubles_then_bisects_to_five_percent():
    from benchmarks.long_chains.sweep import longest_search

    tried = []

    def fits_below(limit):
        def fits(n):
            tried.append(n)
            return n <= limit

        return fits

    n, capped = longest_search(fits_below(5000), 2000, 131072)
    assert not capped and 5000 / 1.05 <= n <= 5000 and tried[:3] == [2000, 4000, 8000]
    assert len(tried) <= 3 + 5  # the bracket 4000..8000 halves to within 5 % in a few steps
    assert longest_search(fits_below(10**9), 2000, 9000) == (9000, True)  # the limit itself is tried last
    n, capped = longest_search(fits_below(700), 2000, 131072)
    assert not capped and 700 / 1.05 <= n <= 700
    assert longest_search(lambda n: False, 16, 64) == (0, False)


@pytest.mark.slow
def test_the_longest_sweep_trains_one_completion_per_micro_batch(tmp_path):
    # gk_auto: the trainer's "auto" choice (the tiny model's 16 tokens fit without checkpoints under the 12 GB cap)
    # (trl_rowfold: trl_ckpt, which the first test runs, with its head's CPU fold by row slices)
    rows, stdout, stderr = _run(tmp_path, "--providers", "trl_rowfold,gk_auto", "--sweeps", "longest")
    # --quick: one length (16 tokens, the limit): TRL's compute_loss and backward per row, ours a budget of one
    if [(r["provider"], r["max_len"], r["status"]) for r in rows] != [("trl_rowfold", "16", "ok"),
                                                                      ("gk_auto", "16", "ok")]:  # fmt: skip
        pytest.fail(f"{[(r['provider'], r['max_len'], r['status']) for r in rows]}\n{_accounts(stderr)}")
    assert "gk_auto     longest single chain: 16 tokens (the --longest-limit 16)" in stdout
    assert 'model.activation_checkpointing = "auto": "none" (estimated activation GiB for a micro-batch of' in stdout
    assert "| gk_auto | 16 |" in (tmp_path / "memory_model.md").read_text()


def test_trl_rowfold_folds_row_slices_with_the_same_log_probs_entropy_and_gradients(monkeypatch):
    """trl_rowfold's TRL head: each CPU fold sees at most ROWFOLD_ROWS rows, and the log-probs, entropies and both
    gradients equal the whole-tile fold's (two token chunks of 200 and 100 rows, three vocabulary chunks)."""
    import torch
    from trl.kernels import chunked_logprob as head

    from benchmarks.long_chains import worker

    rows_seen = []
    def recorded(fold):  # keeps fold's signature (functools.wraps), which trl_rowfold checks
        @functools.wraps(fold)
        def record(tile, *a, **k):
            rows_seen.append(tile.shape[0])
            return fold(tile, *a, **k)

        return record

    for name in ("_forward_tile", "_backward_tile"):  # restored after the test (monkeypatch)
        monkeypatch.setattr(head, name, recorded(getattr(head, name)))
    monkeypatch.setattr(head, "TOKEN_CHUNK_SIZE", 200)
    monkeypatch.setattr(worker, "ROWFOLD_ROWS", 64)
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(300, 24, generator=g, dtype=torch.float64)
    weight = torch.randn(700, 24, generator=g, dtype=torch.float64) / 3
    targets = torch.randint(0, 700, (300,), generator=g)
    up = torch.randn(2, 300, generator=g, dtype=torch.float64)

    def run():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent, *_ = head.ChunkedLogProbFunction.apply(h, w, None, targets, 0.7, 256, None, 1.0,
                                                           ("log_probs", "entropy"))  # fmt: skip
        ((logp * up[0]).sum() + (ent * up[1]).sum()).backward()
        return logp.detach(), ent.detach(), h.grad, w.grad

    whole = run()
    assert max(rows_seen) == 200
    rows_seen.clear()
    worker.trl_rowfold()
    sliced = run()
    assert max(rows_seen) == 64 and sum(rows_seen) == 2 * 3 * 300  # forward and backward: 3 vocabulary chunks each
    for a, b in zip(whole, sliced, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(whole[2], torch.zeros_like(whole[2]))
    # a TRL whose fold takes other arguments is refused, not sliced by the wrong ones
    monkeypatch.setattr(head, "_forward_tile", lambda tile, tile_stride, targets, log_z: None)
    with pytest.raises(RuntimeError, match="_forward_tile takes"):
        worker.trl_rowfold()


# benchmarks/long_chains/best.py: the realistic step at each provider's best micro-batching.


def test_best_search_stops_after_the_fastest_fitting_micro_batching():
    from benchmarks.long_chains.best import search

    def fake(table):
        asked = []

        def measure(k):
            asked.append(k)
            status, step_s = table[k]
            return {"k": k, "status": status, "step_s": step_s}

        return measure, asked

    table = {1: ("over_cap", None), 2: ("ok", 10.0), 4: ("ok", 9.0), 8: ("ok", 9.5), 16: ("ok", 1.0)}
    measure, asked = fake(table)
    assert [r["k"] for r in search(measure, 16)] == asked == [1, 2]  # the first that fits
    measure, asked = fake(table)
    assert [r["k"] for r in search(measure, 16, confirm=True)] == asked == [1, 2, 4, 8]  # 8 slower than 4: stop
    measure, asked = fake({1: ("ok", 5.0), 2: ("over_cap", None), 4: ("ok", 1.0)})
    search(measure, 4, confirm=True)
    assert asked == [1, 2]  # fitted at 1, the next did not: stop
    measure, asked = fake({1: ("over_cap", None), 2: ("over_cap", None)})
    assert [r["status"] for r in search(measure, 2)] == ["over_cap", "over_cap"]  # none fits: every k up to n tried
    # --confirm resumed on a CSV: the rows read back hold strings (538.7 s at k = 1), the new one a float
    measure, asked = fake({1: ("ok", "538.66"), 2: ("ok", 524.7), 4: ("ok", 600.0)})
    assert [r["k"] for r in search(measure, 4, confirm=True)] == [1, 2, 4]


def test_best_lengths_are_seeded_in_range_and_follow_their_distribution():
    from benchmarks.long_chains.best import lengths, points

    assert {(p["prompts"], p["min_len"], p["max_len"]) for p in points(False, prompts=2, min_len=250, max_len=2000)} \
        == {(2, 250, 2000)}  # a smaller step (the options)
    uniform, tail = (p for p in points(False) if p["group_size"] == 16)
    for point in (uniform, tail):
        drawn = lengths(point)
        assert drawn == lengths(point) and len(drawn) == 64 and all(500 <= n <= 8000 for n in drawn)
    assert lengths(uniform) != lengths(tail)
    many = [n for seed in range(40) for n in lengths(tail, seed)]
    median = sorted(many)[len(many) // 2]
    assert 1300 < median < 1700 and 0.005 < sum(n == 8000 for n in many) / len(many) < 0.08  # the stated tail
    many = [n for seed in range(40) for n in lengths(uniform, seed)]
    assert 2450 < sum(many) / len(many) < 2950  # log-uniform mean (8000 - 500) / ln 16 = 2705


def test_best_report_takes_each_providers_fastest_fitting_row_against_trls(tmp_path):
    from benchmarks.long_chains.best import COLUMNS, report

    def row(provider, k, status, step_s="", peak=""):
        return {c: "" for c in COLUMNS} | dict(provider=provider, dist="loguniform", group_size=8, prompts=4, k=k,
                                                min_len=500, max_len=8000 if k < 16 else 2000,
                                                micro_batches=k, status=status, step_s=step_s, peak_rss_mb=peak,
                                                computed_tokens=100, pad_tokens=50 if provider == "trl_ckpt" else 0,
                                                load_before=0.1, timestamp="2026-12-05T00:30:12")  # fmt: skip

    path = tmp_path / "best.csv"
    rows = [row("trl_ckpt", 1, "over_cap"), row("trl_ckpt", 2, "ok", 100, 8000), row("trl_ckpt", 4, "ok", 110, 6000),
            row("gk_blocks", 1, "ok", 70, 4000), row("gk_blocks", 2, "ok", 75, 3000), row("gk_sp", 1, "over_cap"),
            row("trl_rowfold", 1, "ok", 90, 4000), row("gk_blocks", 16, "ok", 1, 1)]  # gk_blocks 16: another point
    # (lengths up to 2000), not the best of the one above
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    text = report(path).read_text()
    assert ("| loguniform | 500-8000 | 8 x 4 | trl_ckpt | 2 | 2 | 100.0 | 8000 | 1.00x | 1.00x | 1.11x | 2.00x | 50% | "
            "0.1 | 2026-12-05 00:30 |") in text  # when it was measured: rows of different runs are told apart
    assert ("| loguniform | 500-8000 | 8 x 4 | gk_blocks | 1 | 1 | 70.0 | 4000 | 0.70x | 0.50x | 0.78x | 1.00x | 0% | "
            "0.1 |") in text  # against TRL and against TRL without its CPU fold (trl_rowfold)
    assert "| 8 x 4 | trl_rowfold | 1 | 1 | 90.0 | 4000 | 0.90x | 0.50x | 1.00x | 1.00x |" in text
    assert "| loguniform | 500-8000 | 8 x 4 | gk_sp | - | - | - | - | - | - | - | - | - | over_cap |" in text
    assert "| loguniform | 500-2000 | 8 x 4 | gk_blocks | 16 | 16 | 1.0 | 1 | - | - | - | - | 0% | 0.1 |" in text


@pytest.mark.slow
def test_trl_micro_batches_are_slices_of_the_padded_step_and_train_in_one_process(tmp_path):
    """One real measurement of the micro-batched TRL provider on the tiny model: 4 completions, one per micro-batch
    (per_device_train_batch_size 1, gradient accumulation over 4), each padded to the step's longest."""
    from benchmarks.long_chains import sweep as lc
    from grpo_kernels.train.model.hf import write_tiny_checkpoint

    model = str(write_tiny_checkpoint(tmp_path / "model"))
    point = dict(sweep="best", dist="loguniform", group_size=2, prompts=2, min_len=16, max_len=64)
    drawn = [64, 20, 33, 16]
    row = lc.measure("trl_ckpt", point, model_dir=model, cap_mb=4096, scratch=str(tmp_path), timeout=300,
                     extra={"micro_rows": 1, "lengths": drawn})  # fmt: skip
    assert row["status"] == "ok", row
    assert row["micro_batches"] == 4 and row["step_s"] > 0
    prompt = len(lc.prompt_ids(model)[0])
    assert row["computed_tokens"] == 4 * (prompt + 64) and row["real_tokens"] == 4 * prompt + sum(drawn)


# benchmarks/long_chains/profile_step.py: where a step's time goes, by phase and kind of op.


def test_profile_summary_files_its_own_ranges_under_python_not_ops():
    """The "block" and "phase:backward" ranges' self time is the Python between the ops: never an op of the table
    (a second binding of the name once hid the ranges, and every profile counted them as ops)."""
    from types import SimpleNamespace

    from benchmarks.long_chains.profile_step import profile_summary

    def event(name, start, end, self_us):
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, time_range=span, self_cpu_time_total=self_us)

    events = [event("phase:backward", 0, 3000, 700.0), event("block", 100, 900, 300.0),
              event("aten::mm", 200, 800, 600.0)]  # fmt: skip
    summary = profile_summary(events, step_s=0.004)
    assert set(summary["top_ops_ms"]) == {"aten::mm"}
    assert summary["categories_ms"]["Python and glue"] == 1.0  # 700 + 300 us
    assert summary["phases_ms"]["of which recompute"] == 0.8  # the block inside the backward


@pytest.mark.parametrize("mode", ["blocks", "none"])
def test_profile_tells_the_backwards_recompute_from_the_forward(tmp_path, mode):
    import json

    import torch

    from benchmarks.long_chains import worker
    from benchmarks.long_chains.profile_step import table
    from grpo_kernels import fused_linear_grpo_loss
    from grpo_kernels.train.model.activation import checkpoint_blocks

    torch.manual_seed(0)
    mlp = lambda: torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64))  # noqa
    blocks = torch.nn.ModuleList(mlp() for _ in range(3))
    spec = {"profile": str(tmp_path / "p.json")}
    worker._label_blocks(blocks, spec)
    if mode != "none":
        checkpoint_blocks(blocks, mode)
    optimizer = torch.optim.AdamW(blocks.parameters())
    x = torch.randn(512, 64, requires_grad=True)

    head = torch.nn.Linear(64, 20000, bias=False)  # most of the forward's time
    forward_s = []

    def step():
        start = time.perf_counter()
        h = x
        for block in blocks:
            h = h + block(h)
        # the fused head, which computes its gradients in its forward (torch.autograd.grad): forward, not backward
        loss, _ = fused_linear_grpo_loss(h.view(4, 128, 64), head.weight, torch.randint(0, 20000, (4, 128)),
                                         torch.tensor([1.0, -1.0, 0.5, -0.5]), mask=torch.ones(4, 128))  # fmt: skip
        forward_s.append(time.perf_counter() - start)
        loss.backward()
        optimizer.step()

    _, seconds = worker._timed(step, spec)
    s = json.loads((tmp_path / "p.json").read_text())
    phases, cats = s["phases_ms"], s["categories_ms"]
    assert seconds > 0 and set(phases) == {"forward and loss", "of which decoder blocks", "backward",
                                           "of which recompute", "optimizer"}  # fmt: skip
    assert 0 < phases["of which decoder blocks"] <= phases["forward and loss"]
    assert phases["forward and loss"] >= 0.9 * forward_s[0] * 1000  # the head's forward is not in the backward
    if mode == "blocks":  # the backward runs each block's forward again
        assert 0 < phases["of which recompute"] <= phases["backward"]
    else:
        assert phases["of which recompute"] == 0
    assert cats["matmul (projections, MLP, head)"] > 0 and cats["optimizer (AdamW)"] > 0
    assert "aten::mm" in s["top_ops_ms"] and s["user_cpu_s"] > 0  # the head's matmuls
    row = dict(s, model="toy", group_size=2, length=8, load_before=0.5, computed_tokens=16)
    text = table({"gk_blocks": row})
    assert "| phase: of which recompute s |" in text and "| ops: matmul (projections, MLP, head) s |" in text
