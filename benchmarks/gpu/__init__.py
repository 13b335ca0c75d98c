"""Stages for a lent H100/H200 machine, each one call with its own time limit, each with a CPU dry run tested in CI
(tests/test_gpu_stages.py). `ops_limits`: the ops against the hardware's limits (the ops' targets of the GPU issue)."""
