#!/usr/bin/env bash
# One call on a lent H100/H200 machine; everything it writes lands under OUTDIR (default benchmarks/results/gpu_run):
#   nvidia-smi.txt   the card as found (name, driver, clocks, load)
#   build.log        the C++ extension (grpo_kernels imports it; the tests compare against it on the CPU)
#   gpu_check.csv    benchmarks/gpu_check.py: every CUDA path against the reference, then timed against baselines
#   gpu_check.log    its output
#   profile.txt      benchmarks/gpu_profile.py: host syncs, kernel launches and top kernels of each op
#   ops_limits.csv   benchmarks/gpu/ops_limits.py: the ops against the copy / torch.compile targets, determinism
#   tests.log        the kernel tests whose id names Triton, run on CUDA (conftest picks the device)
#   tests.xml        their JUnit report
# usage: benchmarks/gpu_run.sh [OUTDIR]   (BUILD_S, LIMITS_S, CHECK_S, PROFILE_S, TEST_S: each stage's limit, seconds;
#                                          TESTS: the test files, default the kernels')
set -u
out=${1:-benchmarks/results/gpu_run}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
MAX_JOBS=16 timeout "${BUILD_S:-90}" "$py" setup.py build_ext --inplace -q > "$out/build.log" 2>&1
echo "build exit $?" | tee -a "$out/build.log"
timeout "${LIMITS_S:-150}" "$py" -m benchmarks.gpu.ops_limits --out "$out" > "$out/ops_limits.log" 2>&1
echo "ops_limits exit $?" | tee -a "$out/ops_limits.log"
timeout "${CHECK_S:-180}" "$py" benchmarks/gpu_check.py --out "$out/gpu_check.csv" > "$out/gpu_check.log" 2>&1
echo "gpu_check exit $?" | tee -a "$out/gpu_check.log"
timeout "${PROFILE_S:-90}" "$py" benchmarks/gpu_profile.py --out "$out/profile.txt" > "$out/profile.log" 2>&1
echo "gpu_profile exit $?" | tee -a "$out/profile.log"
tests=${TESTS:-tests/test_advantages.py tests/test_fused_entropy.py tests/test_fused_linear.py tests/test_logprobs.py \
tests/test_loss.py tests/test_loss_from_logits.py tests/test_nonfinite.py tests/test_backend_verdicts.py}
# shellcheck disable=SC2086  # $tests: a list of paths
timeout "${TEST_S:-100}" "$py" -m pytest -q -n 8 -p no:cacheprovider --timeout 90 -k triton --junitxml "$out/tests.xml" \
    $tests > "$out/tests.log" 2>&1
echo "tests exit $?" | tee -a "$out/tests.log"
grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -20
tail -3 "$out/tests.log"
grep -E "host syncs|launches|chunk_tokens|addmm|^##|Error" "$out/profile.log" | head -40
tail -32 "$out/gpu_check.log"
grep -vE "^(USDT|  (launches|syncs))" "$out/ops_limits.log" | tail -16
