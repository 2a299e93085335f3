# replay: `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
PYTEST ?= $(PYTHON) -m pytest
# Tests run the package from this checkout, installed or not (the GPU machine has no network).
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: setup demo test test-e2e test-all test-gpu test-slow bench soak report-check clean help

help:
	@echo "make demo      record the reference engine drifting on CPU, show the divergence, re-run the step"
	@echo "make test      the fast CPU suite (what CI runs): unit tests, architecture checks, an end-to-end smoke"
	@echo "make test-e2e  the multi-process end-to-end CPU tests (minutes)"
	@echo "make test-all  both"
	@echo "make test-gpu  GPU tests (one or two CUDA GPUs)"
	@echo "make bench     recorder overhead, digest and writer throughput, info speed"
	@echo "make soak      long recording soak run (8 ranks, thousands of steps)"

# Keep an existing torch (CPU or CUDA); install the CPU build only when there is none, so a bare
# `torch` requirement never pulls a multi-GB CUDA build. Then everything else the tests need.
setup: .make/setup
.make/setup: pyproject.toml scripts/ensure_deps.py
	$(PYTHON) scripts/ensure_deps.py
	@mkdir -p .make && touch $@

demo: setup
	$(PYTHON) scripts/demo.py

CPU := not gpu and not multigpu and not slow

# The CPU suites run on JOBS pytest workers (pytest-xdist; CI has two cores). Tests that share a
# module-scoped fixture (a multi-process recording) stay on one worker (tests/conftest.py);
# every worker has its own tmp directory. JOBS=0, or no pytest-xdist (an offline machine that
# `make setup` could not install it on), runs everything in one process. Expanded when a recipe
# runs, after `setup`. pytest-benchmark, where installed, only warns that xdist turns it off.
JOBS ?= 2
XDIST = $(if $(filter 0,$(JOBS)),,$(if $(shell $(PYTHON) -c "import xdist" 2>/dev/null && echo y),-n $(JOBS) --dist loadgroup -p no:benchmark))
# pytest exits 5 when a selection holds no test (every e2e test marked smoke, say): not a failure.
NONE_IS_OK := || [ $$? -eq 5 ]

# The end-to-end tests that record multi-process runs take most of the time; `make test` keeps
# only those marked smoke (tests/test_architecture.py, the layer and complexity checks, runs here).
test: setup
	$(PYTEST) -q $(XDIST) -m "$(CPU) and (not e2e or smoke)" -p no:cacheprovider $(NONE_IS_OK)

test-e2e: setup
	$(PYTEST) -q $(XDIST) -m "$(CPU) and e2e and not smoke" -p no:cacheprovider $(NONE_IS_OK)

test-all: setup
	$(PYTEST) -q $(XDIST) -m "$(CPU)" -p no:cacheprovider $(NONE_IS_OK)

test-gpu: setup
	$(PYTEST) -q -m "gpu or multigpu" -p no:cacheprovider

test-slow: setup
	$(PYTEST) -q -m "slow" -p no:cacheprovider

bench: setup
	$(PYTHON) benchmarks/run_all.py

soak: setup
	$(PYTEST) -q -m slow tests/test_soak.py -p no:cacheprovider

# Render a report (RUN=path, or a synthetic demo recording) and screenshot it in headless
# Chromium (apt-get install chromium).
report-check: setup
	$(PYTHON) scripts/report_check.py $(if $(RUN),$(RUN),--demo)

clean:
	rm -rf .make .pytest_cache build *.egg-info
