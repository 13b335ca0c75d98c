#!/usr/bin/env bash
# The GPU stages on a lent H100/H200 machine, in calls that fit a visit (600 s a command, 900 s of device time in all
# with the machine's start, the last 12,000 characters of output and at most 8 files back).
#
# usage: [STAGES="..."] [BUDGET_S=540] [QUICK=1] [MODES=a,b] [WHEELS=DIR] [DRY_RUN=1] benchmarks/gpu/run.sh [OUTDIR]
#
# OUTDIR (default benchmarks/results/gpu_run) is the folder that comes back: it holds gpu_run.tgz, re-packed after
# every stage (so a call cut off at its limit still returns every stage that ended), and run.log. The stages write
# their files under WORK (default: a fresh temp folder; the archive holds it as gpu_run/), not in OUTDIR, which so
# never holds more than those two files. Before anything else: the device and the versions of every package the
# stages need (versions.txt). HF_HUB_OFFLINE=1 (the machine has no network). A failed build stops the call.
#
# The two prepared calls (a visit: the machine's start, ~60-120 s, then call 1, then call 2 at once, then give the
# machine back):
#   call 1, the ops:     STAGES="build tests limits" BUDGET_S=300 benchmarks/gpu/run.sh OUTDIR
#   call 2, the trainer: STAGES="learns resume speed trl" WHEELS=DIR BUDGET_S=<device time left - 90, <= 480> \
#                            benchmarks/gpu/run.sh OUTDIR
# Estimated H100 times (not measured; how: below): call 1 ~235 s (build 45, tests 90, limits 100), call 2 ~395 s
# (learns 120, resume 40, speed 120, trl 115); together with the start ~750 s of the 900.
# When less time is left, the budget drops stages from the end of the list (each needs its NEED_S); drop in this
# order: trl, then speed's modes (MODES=blocks,auto), then speed, then resume; in call 1, limits before tests. check
# and profile (op timings against eager/compile, where time goes) are in neither call: add them when time is left.
#
# The stages (STAGES picks them and their order):
#   build    the C++ extension (grpo_kernels imports it): build.log. Dry run: setup.py --dry-run (nothing replaced).
#   tests    the kernel tests on CUDA: those whose id or marker names triton (the one-launch kernels' launch counts
#            and counters included): tests.log, tests.xml. Dry run: the same selection collected (--collect-only).
#   limits   ops_limits.py: the ops against the copy / torch.compile targets, determinism: ops_limits.csv
#   check    check.py (--quick with QUICK=1): every CUDA path against the reference, then timed: gpu_check.csv
#   profile  profile_ops.py: host syncs, launches, top kernels of each op: profile.txt (CUDA only: no dry run)
#   learns   trainer_learns.py under torchrun (NCCL): the learning check's six seeds in fp32: trainer_learns.csv
#   resume   trainer_resume.py under torchrun (NCCL): DCP save and resume of CUDA state: trainer_resume.csv
#   speed    trainer_speed.py (--modes from MODES): a Qwen2.5-1.5B shape per checkpointing mode: trainer_speed.csv
#   trl      trl_side_by_side.py: TRL, the drop-in and our step on one model and batch: trl_side_by_side.csv (needs
#            TRL: WHEELS=DIR, a folder of the wheels in benchmarks/gpu/wheels.txt, installed into WORK first)
# Each stage's limit is <NAME>_S (default in LIMITS below), cut to what is left of BUDGET_S (less RESERVE_S for the
# last pack); a stage runs only if at least its NEED_S is left. DRY_RUN=1 runs each stage's own CPU dry run.
#
# How the times were estimated (nothing here has run on an H100 since the kernels were rewritten): build from this
# project's build (5 translation units, 81 s in a row on one core, beside other work: on 16 cores the longest, 32 s);
# tests from the H200 visit of 2026-12-04 (265 kernel tests in 43 s on 8 workers, most of it Triton's compiles) plus
# the tests added since; limits from its work (two torch.compile builds ~30 s each, 3 x 2 do_bench medians, 40
# determinism calls, a profile); learns from the CPU check (six seeds, 52 s of CPU for a tiny decoder whose steps are
# launch-bound on a GPU: about the same host time, plus CUDA start-up and Triton compiles); speed and trl from their
# FLOPs (a train step of 86k tokens of a 1.5B model ~0.8 PFLOP, ~3 s at 35 % of 800 TFLOP/s with recompute; models
# built on the GPU, seconds each) and the HF sampler's 1,024 decode steps (~20 s).
set -u
out=${1:-benchmarks/results/gpu_run}
py=${PYTHON:-python3}
stages=" ${STAGES:-build tests limits} "
budget=${BUDGET_S:-540}
reserve=${RESERVE_S:-15}
dry=${DRY_RUN:-0}
start=$(date +%s)
deadline=$((start + budget))
mkdir -p "$out"
work=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_run.XXXXXX")}
mkdir -p "$work"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# stage: default limit (s), least time worth starting it with (s)
declare -A LIMITS=([build]=150 [tests]=150 [limits]=150 [check]=180 [profile]=90 [learns]=240 [resume]=90 \
    [speed]=200 [trl]=200)
declare -A NEED=([build]=30 [tests]=60 [limits]=60 [check]=90 [profile]=45 [learns]=120 [resume]=40 [speed]=90 \
    [trl]=90)

say() { echo "$*" | tee -a "$work/run.log"; }
pack() {  # the whole work folder but the installed wheels, replacing the archive only once the new one is complete
    tar czf "$out/gpu_run.tgz.part" --exclude=site -C "$work" --transform 's,^\.,gpu_run,' . \
        && mv "$out/gpu_run.tgz.part" "$out/gpu_run.tgz"
    cp "$work/run.log" "$out/run.log"
}
want() { [[ "$stages" == *" $1 "* ]]; }
dry_flag() { [ "$dry" = 1 ] && echo --dry-run; }
# run_stage NAME COMMAND...: under its time limit, output in WORK/NAME.log; returns the command's exit status.
run_stage() {
    local name=$1 left limit t0 rc
    shift
    left=$((deadline - $(date +%s) - reserve))
    limit=$(eval "echo \${${name^^}_S:-${LIMITS[$name]}}")
    if ((left < NEED[$name])); then
        say "$name: skipped: ${left} s left of BUDGET_S=${budget}, it needs ${NEED[$name]}"
        skipped+=("$name")
        return 3
    fi
    ((limit > left)) && limit=$left
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$work/$name.log" 2>&1
    rc=$?
    say "$name: exit $rc after $(($(date +%s) - t0)) s (limit $limit s)$( ((rc == 124 || rc == 137)) && echo ': TIMED OUT')"
    ((rc == 0)) || failed+=("$name")
    pack
    return $rc
}

failed=() skipped=()
say "gpu run: stages${stages% }, BUDGET_S=$budget, DRY_RUN=$dry, QUICK=${QUICK:-0}, work folder $work"
if [ -n "${WHEELS:-}" ]; then  # packages the image lacks, into a private target (nothing of the image is replaced)
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$WHEELS"/*.whl \
        && export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}" || say "wheels from $WHEELS: install failed"
fi
"$py" -m benchmarks.gpu.versions --out "$work/versions.txt" 2>&1 | tee -a "$work/run.log"
{ command -v nvidia-smi > /dev/null && nvidia-smi || echo "nvidia-smi: not found"; } > "$work/nvidia-smi.txt" 2>&1
pack

if want build; then
    build=("$py" setup.py build_ext --inplace -q)
    [ "$dry" = 1 ] && build=("$py" setup.py --dry-run build_ext --inplace)  # the live extension left untouched
    MAX_JOBS=16 run_stage build "${build[@]}" || {
        say "build did not succeed: every stage imports grpo_kernels._C, so nothing else runs (build.log)"
        tail -n 30 "$work/build.log"
        exit 1
    }
fi
if want tests; then
    tests=${TESTS:-tests/test_advantages.py tests/test_advantages_launches.py tests/test_fused_entropy.py \
tests/test_fused_linear.py tests/test_logprobs.py tests/test_loss.py tests/test_loss_fused.py tests/test_loss_from_logits.py \
tests/test_nonfinite.py tests/test_backend_verdicts.py tests/test_fuzz_kernels.py}
    args=(-q -p no:cacheprovider -k triton --junitxml "$work/tests.xml")
    if [ "$dry" = 1 ]; then
        args+=(--collect-only)
    else
        args+=(-n 8)
        "$py" -c "import pytest_timeout" 2> /dev/null && args+=(--timeout 90)
    fi
    # shellcheck disable=SC2086  # $tests: a list of paths
    run_stage tests "$py" -m pytest "${args[@]}" $tests
fi
if want limits; then
    # shellcheck disable=SC2046  # dry_flag: one word or none
    run_stage limits "$py" -m benchmarks.gpu.ops_limits $(dry_flag) --out "$work"
fi
if want check; then
    quick=()
    [ "${QUICK:-0}" = 1 ] && quick=(--quick)
    # shellcheck disable=SC2046
    run_stage check "$py" benchmarks/gpu/check.py $(dry_flag) "${quick[@]}" --out "$work/gpu_check.csv"
fi
if want profile; then
    if [ "$dry" = 1 ]; then
        say "profile: no dry run (it profiles CUDA kernels only): not run"
    else
        run_stage profile "$py" benchmarks/gpu/profile_ops.py --out "$work/profile.txt"
    fi
fi
torchrun=("$py" -m torch.distributed.run --standalone --nproc_per_node=1)
# shellcheck disable=SC2046
want learns && run_stage learns "${torchrun[@]}" -m benchmarks.gpu.trainer_learns $(dry_flag) --out "$work"
# shellcheck disable=SC2046
want resume && run_stage resume "${torchrun[@]}" -m benchmarks.gpu.trainer_resume $(dry_flag) --out "$work"
if want speed; then
    modes=()
    [ -n "${MODES:-}" ] && modes=(--modes "$MODES")
    # shellcheck disable=SC2046
    run_stage speed "$py" -m benchmarks.gpu.trainer_speed $(dry_flag) "${modes[@]}" --out "$work"
fi
# shellcheck disable=SC2046
want trl && run_stage trl "$py" -m benchmarks.gpu.trl_side_by_side $(dry_flag) --out "$work"

# What the output's tail should show: each stage's verdict lines.
want tests && [ -f "$work/tests.log" ] && { grep -E "^(FAILED|ERROR)" "$work/tests.log" | head -20; tail -n 3 "$work/tests.log"; }
want profile && [ -f "$work/profile.log" ] && grep -E "host syncs|launches|chunk_tokens|addmm|^##|Error" "$work/profile.log" | head -40
want limits && [ -f "$work/limits.log" ] && grep -vE "^(USDT|  (launches|syncs))" "$work/limits.log" | tail -n 16
want check && [ -f "$work/check.log" ] && tail -n 32 "$work/check.log"
for stage in learns resume speed; do want $stage && [ -f "$work/$stage.log" ] && tail -n 8 "$work/$stage.log"; done
want trl && [ -f "$work/trl.log" ] && grep -E "^\{|exit|trl |error" "$work/trl.log" | tail -n 16
say "gpu run: done in $(($(date +%s) - start)) s of BUDGET_S=$budget; failed: ${failed[*]:-none}; skipped: ${skipped[*]:-none}"
pack
echo "packed $out/gpu_run.tgz"
((${#failed[@]} == 0))
