# FedSketch: `make demo` runs the main job, `make test` runs the test suite.
# Both create the virtual environment .venv in this checkout on first use and
# reuse it while setup.py, pyproject.toml, this Makefile and ext/ are unchanged.

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
# torch goes in first, pinned, so nothing pulls a multi-GB CUDA build by accident.
# Elsewhere: make TORCH_INDEX=<a CPU wheel index URL> (see README, "Installing torch").
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS      ?= server,broker,dev
# Flower goes in after the rest (setup.py says why); FLOWER= (empty) leaves it out
FLOWER      ?= flower
STAMP       := $(VENV)/.fedsketch-installed
PYTEST_ARGS ?=
# Test processes (pytest-xdist), each taking whole files: most tests wait on brokers and devices, so three
# keep 2 cores busier than two (8.5 min against 10 on 2 cores). TEST_WORKERS=0 runs them in this process.
# The tests marked "alone" run afterwards, in one process.
TEST_WORKERS ?= 3
XDIST       := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

.PHONY: all venv demo test test-numpy lint bench dist dist-pi clean distclean

all: test

$(STAMP): setup.py pyproject.toml Makefile ext/bits.pyx
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet "setuptools>=68" wheel "Cython>=3.0" "numpy>=1.24"
	@$(PY) -c "import torch" 2>/dev/null || \
	  $(PIP) install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PIP) install --no-build-isolation -e ".[$(EXTRAS)]"
	$(if $(FLOWER),$(PIP) install --no-build-isolation -e ".[$(FLOWER)]")
	@$(PY) -c "import edge_sdk; print('fedsketch', edge_sdk.__version__, 'kernel:', edge_sdk.BACKEND)"
	@touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m server_kit.demo

# Each stage says how long it took (the README has the times on 2 cores).
STAGE = t=$$(date +%s); $(2); rc=$$?; echo "make test: $(1) took $$(( $$(date +%s) - t )) s"; exit $$rc

test: $(STAMP)
	@$(call STAGE,lint and structure,$(PY) -m ruff check edge_sdk server_kit benchmarks tests && $(PY) benchmarks/structure.py >/dev/null)
	@$(call STAGE,the tests,$(PY) -m pytest -q $(XDIST) -m "not alone" $(PYTEST_ARGS))
	@$(call STAGE,the tests run alone,$(PY) -m pytest -q -m alone $(PYTEST_ARGS))
	@$(call STAGE,the edge tests on the numpy kernels,FEDSKETCH_PURE_NUMPY=1 $(PY) -m pytest -q $(XDIST) tests/edge_sdk $(PYTEST_ARGS))

lint: $(STAMP)
	$(PY) -m ruff check edge_sdk server_kit benchmarks tests

bench: $(STAMP)
	$(PY) benchmarks/bits.py
	$(PY) benchmarks/edge_overhead.py

# dist/: the sdist (what a Raspberry Pi installs: it compiles the Cython kernel there) and a wheel
# for this machine's platform, built from that sdist, offline (no build isolation).
dist: $(STAMP)
	rm -rf dist/fedsketch-*
	@mkdir -p build
	$(PY) setup.py -q egg_info --egg-base build sdist -d dist
	$(PIP) wheel --quiet --no-deps --no-build-isolation -w dist dist/fedsketch-*.tar.gz
	@ls -l dist/fedsketch-*
	@echo "the Raspberry Pi wheel (manylinux aarch64, built under emulation, needs root and qemu): sudo make dist-pi"

# dist/fedsketch-<version>-cp311-cp311-manylinux_*_aarch64.whl: what a Raspberry Pi (64-bit OS, Python 3.11)
# installs without a compiler. Built in an emulated arm64 Debian root (deploy/pi/build_wheel_aarch64.sh).
dist-pi: dist
	bash deploy/pi/build_wheel_aarch64.sh "$$(ls -t dist/fedsketch-*.tar.gz | head -n 1)" dist

clean:
	rm -rf build *.egg-info edge_sdk/_bits*.so ext/*.c .pytest_cache reports

distclean: clean
	rm -rf $(VENV)
