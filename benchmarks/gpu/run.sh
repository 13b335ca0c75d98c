#!/usr/bin/env bash
# One call on a lent H100/H200 machine; everything it writes lands under OUTDIR (default benchmarks/results/gpu_run),
# then packed into OUTDIR.tgz (one file to copy back). The stages, in the order they run (STAGES picks them):
#   build     the C++ extension (grpo_kernels imports it; the tests compare against it on the CPU): build.log
#   limits    benchmarks/gpu/ops_limits.py: the ops against the copy / torch.compile targets, determinism:
#             ops_limits.csv, ops_limits.log
#   check     benchmarks/gpu/check.py: every CUDA path against the reference, then timed: gpu_check.csv, .log
#   profile   benchmarks/gpu/profile_ops.py: host syncs, kernel launches and top kernels of each op: profile.txt
#   tests     the kernel tests whose id names Triton, run on CUDA (conftest picks the device): tests.log, tests.xml
#   learns    benchmarks/gpu/trainer_learns.py under torchrun (NCCL): trainer_learns.csv, learns_seed*/
#   speed     benchmarks/gpu/trainer_speed.py: a Qwen2.5-1.5B shape, each checkpointing mode: trainer_speed.csv
#   trl       benchmarks/gpu/trl_side_by_side.py: TRL, the drop-in and our step on the same batch: trl_side_by_side.csv
#             (needs TRL: WHEELS=DIR, a folder of the wheels in benchmarks/gpu/wheels.txt, installed first)
#   resume    benchmarks/gpu/trainer_resume.py under torchrun (NCCL): trainer_resume.csv, resume_a/, resume_b/
# usage: [STAGES="build limits check tests"] benchmarks/gpu/run.sh [OUTDIR]
#   default STAGES: build limits check profile tests (the ops); the trainer's: STAGES="build learns speed trl resume".
#   Each stage's time limit in seconds: BUILD_S, LIMITS_S, CHECK_S, PROFILE_S, TEST_S, LEARNS_S, SPEED_S, TRL_S,
#   RESUME_S;
#   TESTS: the test files of "tests", default the kernels'. nvidia-smi.txt: the card as found.
set -u
out=${1:-benchmarks/results/gpu_run}
py=${PYTHON:-python3}
stages=" ${STAGES:-build limits check profile tests} "
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
want() { [[ "$stages" == *" $1 "* ]]; }
if [ -n "${WHEELS:-}" ]; then  # packages the image lacks, into a private target (nothing of the image is replaced)
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$out/site" "$WHEELS"/*.whl \
        && export PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}" || echo "wheels from $WHEELS: install failed"
fi
if want build; then
    MAX_JOBS=16 timeout "${BUILD_S:-90}" "$py" setup.py build_ext --inplace -q > "$out/build.log" 2>&1
    echo "build exit $?" | tee -a "$out/build.log"
fi
if want limits; then
    timeout "${LIMITS_S:-150}" "$py" -m benchmarks.gpu.ops_limits --out "$out" > "$out/ops_limits.log" 2>&1
    echo "ops_limits exit $?" | tee -a "$out/ops_limits.log"
fi
if want check; then
    timeout "${CHECK_S:-180}" "$py" benchmarks/gpu/check.py --out "$out/gpu_check.csv" > "$out/gpu_check.log" 2>&1
    echo "gpu_check exit $?" | tee -a "$out/gpu_check.log"
fi
if want profile; then
    timeout "${PROFILE_S:-90}" "$py" benchmarks/gpu/profile_ops.py --out "$out/profile.txt" > "$out/profile.log" 2>&1
    echo "gpu_profile exit $?" | tee -a "$out/profile.log"
fi
if want tests; then
    tests=${TESTS:-tests/test_advantages.py tests/test_advantages_launches.py tests/test_fused_entropy.py \
tests/test_fused_linear.py tests/test_logprobs.py tests/test_loss.py tests/test_loss_fused.py tests/test_loss_from_logits.py \
tests/test_nonfinite.py tests/test_backend_verdicts.py}
    # shellcheck disable=SC2086  # $tests: a list of paths
    timeout "${TEST_S:-100}" "$py" -m pytest -q -n 8 -p no:cacheprovider --timeout 90 -k triton \
        --junitxml "$out/tests.xml" $tests > "$out/tests.log" 2>&1
    echo "tests exit $?" | tee -a "$out/tests.log"
fi
if want learns; then
    timeout "${LEARNS_S:-280}" "$py" -m torch.distributed.run --standalone --nproc_per_node=1 \
        -m benchmarks.gpu.trainer_learns --out "$out" > "$out/trainer_learns.log" 2>&1
    echo "trainer_learns exit $?" | tee -a "$out/trainer_learns.log"
fi
if want speed; then
    timeout "${SPEED_S:-280}" "$py" -m benchmarks.gpu.trainer_speed --out "$out" > "$out/trainer_speed.log" 2>&1
    echo "trainer_speed exit $?" | tee -a "$out/trainer_speed.log"
fi
if want trl; then
    timeout "${TRL_S:-280}" "$py" -m benchmarks.gpu.trl_side_by_side --out "$out" > "$out/trl_side_by_side.log" 2>&1
    echo "trl_side_by_side exit $?" | tee -a "$out/trl_side_by_side.log"
fi
if want resume; then
    timeout "${RESUME_S:-200}" "$py" -m torch.distributed.run --standalone --nproc_per_node=1 \
        -m benchmarks.gpu.trainer_resume --out "$out" > "$out/trainer_resume.log" 2>&1
    echo "trainer_resume exit $?" | tee -a "$out/trainer_resume.log"
fi
want tests && { grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -20; tail -3 "$out/tests.log"; }
want profile && grep -E "host syncs|launches|chunk_tokens|addmm|^##|Error" "$out/profile.log" | head -40
want limits && grep -vE "^(USDT|  (launches|syncs))" "$out/ops_limits.log" | tail -16
want check && tail -32 "$out/gpu_check.log"
for stage in learns speed resume; do want $stage && tail -8 "$out/trainer_$stage.log"; done
want trl && grep -E "^\{|exit|trl " "$out/trl_side_by_side.log" | tail -16
rm -rf "$out/site"
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && echo "packed $out.tgz"
