# The README's commands. `make setup` is idempotent; every other target runs it first.
PY    := .venv/bin/python
TORCH ?= torch==2.13.0
STAMP := .venv/.setup-stamp

.PHONY: setup build demo test bench lint clean

setup: build

$(STAMP): pyproject.toml setup.py
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel ninja
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	touch $@

# Incremental (ninja) rebuild of grpo_kernels._C after a change in csrc/.
build: $(STAMP)
	@mkdir -p build
	@$(PY) setup.py build_ext --inplace > build/build.log 2>&1 || (cat build/build.log; exit 1)
	$(PY) -c "import grpo_kernels._C"

demo: setup
	$(PY) -m grpo_kernels.cli demo
	$(PY) -m grpo_kernels.cli train --config examples/train_tiny_cpu.toml
	$(PY) -m grpo_kernels.cli plot runs/tiny-cpu

test: setup lint
	$(PY) -m pytest -q tests

bench: setup
	$(PY) benchmarks/bench_advantages.py
	$(PY) benchmarks/bench_logprobs.py
	$(PY) benchmarks/bench_loss.py
	$(PY) benchmarks/bench_fused_linear.py
	$(PY) benchmarks/bench_packing.py
	$(PY) benchmarks/bench_planner.py

lint: $(STAMP)
	.venv/bin/ruff check grpo_kernels tests benchmarks setup.py

clean:
	rm -rf build grpo_kernels/*.so .venv
