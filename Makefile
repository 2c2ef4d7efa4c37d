# Glassbox developer entry points.
#   make setup   install system packages, .venv, torch (CPU), glassbox[test], and compile the
#                C++ CPU kernels (about 1 min on 2 idle cores, 4+ on busy ones; progress shown)
#   make test    ruff (lint + format check), then the test suite and the session notebooks (nbval)
#   make lint    ruff only
#   make run     the main job
#   make test-gpu  GPU tests + GPU benchmarks, on a CUDA machine (results under $$OUT)
#   make fuzz    the full schemathesis run (~5 min on 2 cores; docs/reliability.md)
#   make soak    5,000 mixed requests against glassbox serve, memory sampled (~30 min on 2 cores)
#   make bench-cpu-threads  torch thread counts on this machine's cores (docs/reliability.md)
#   make bench-async  async scheduling on against off, default model on the CPU (~10 min)
#   make bench-spec   n-gram speculation on against off, default model on the CPU (~5 min)

PYTHON := .venv/bin/python
# Session notebooks, run top to bottom by nbval (only when at least one exists).
# --nbval-lax: only cells marked `# NBVAL_CHECK_OUTPUT` have their outputs
# compared; every other cell must merely run without error. The sanitize file
# blanks memory addresses, pids, temp paths and durations before comparing.
# See sessions/README.md.
NOTEBOOKS := $(shell find sessions -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' -not -path '*/gpu_outputs/*' 2>/dev/null | sort)
NBVAL_ARGS := $(if $(strip $(NOTEBOOKS)),--nbval-lax --nbval-current-env --nbval-sanitize-with sessions/nbval_sanitize.cfg $(NOTEBOOKS))

# What ruff checks (line length 100, rules in pyproject.toml).
LINT_PATHS := engine tui tests benchmarks scripts

.PHONY: setup test lint run test-gpu fuzz soak bench-cpu-threads bench-async bench-spec

setup:
	bash scripts/setup.sh

# Test processes (pytest-xdist). Most tests wait on engine processes, sockets and sleeps, so
# two share 2 cores well; each test file (a notebook too) stays in one process, in order,
# with its module fixtures. TEST_WORKERS=0 runs everything in this process, the default where
# nvidia-smi exists: the GPU tests size their engines by the memory of a device they do not share.
TEST_WORKERS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),0,2)

# Lint first (seconds), then every test; the 15 slowest are listed at the end.
test: lint
	$(PYTHON) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=15 \
		tests $(NBVAL_ARGS)

lint:
	$(PYTHON) -m ruff check $(LINT_PATHS)
	$(PYTHON) -m ruff format --check $(LINT_PATHS)

run:
	.venv/bin/glassbox trace "What is the capital of France?"

test-gpu:
	bash scripts/gpu_run.sh all

fuzz:
	GLASSBOX_SCHEMATHESIS_MAX_EXAMPLES=1000 $(PYTHON) -m pytest -q -p no:cacheprovider tests/reliability/test_schemathesis.py

soak:
	$(PYTHON) -m tests.reliability.soak --requests 5000 --out soak_cpu.json

bench-cpu-threads:
	$(PYTHON) -m benchmarks.cpu_threads --repeats 3 --out cpu_threads/

bench-async:
	$(PYTHON) benchmarks/async_scheduling.py --device cpu --rounds 3 --out out/

bench-spec:
	$(PYTHON) benchmarks/spec_decode.py --device cpu --rounds 2 --out out/
