# The two set-up commands of the README: `make train` and `make test`.
# Each creates .venv (if missing) and installs plugtron, plugtron-gpt, plugtron-moe and their
# dependencies.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CC     ?= cc
BLEND  := plugins/datasets/index_helpers.so

.PHONY: train test lint install clean

$(STAMP): setup.cfg gpt_plugin/setup.cfg moe_plugin/setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]' -e ./gpt_plugin -e ./moe_plugin
	touch $(STAMP)

# The sequential loops of Megatron's index building, compiled (optional: without a C compiler
# the same arrays come from numpy/Python, slower). -ffp-contract=off: a fused multiply-add
# (were -mfma ever added) would round w*s - count once instead of twice and change the blend.
$(BLEND): plugins/datasets/index_helpers.c
	-$(CC) -O3 -ffp-contract=off -shared -fPIC -o $@ $<

install: $(STAMP) $(BLEND)

## Train the default small GPT on the Python standard library's source (ARGS="..." adds flags).
train: $(STAMP) $(BLEND)
	$(VENV)/bin/plugtron train $(ARGS)

## Run the whole test suite: test files spread over JOBS pytest workers (a file's rank pool
## stays in one worker), then the few tests that must run alone. One OpenMP thread per process:
## the workers, their rank pools and the runs they start already fill the cores, and
## oversubscribed OpenMP threads spin (the default-job test took 131 s with torch's default of
## one thread per core, 23 s with one).
## Each part's timings go to build/test-*.xml: `python benchmarks/suite_costs.py` sums them by
## file (what each part of the suite costs).
## Two workers on 2 cores: a third was slower (2026-12-06: 20.7 minutes against 19.5 with
## two), the ranks of each worker's pools already fill the cores.
JOBS ?= 2
test: $(STAMP) $(BLEND)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(JOBS) --dist loadfile -m "not serial" --durations=30 \
		--junitxml=build/test-parallel.xml $(ARGS)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m serial --junitxml=build/test-serial.xml $(ARGS); \
		rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

## Lint: ruff (pyflakes, pycodestyle, import order, function-level imports only with a reason)
## on the whole tree, then mypy (strict optional) on the core, the API, the CLI, the built-in
## plugins and the plugtron-gpt and plugtron-moe packages. mypy finds modules by their paths,
## and setup.cfg maps plugtron.core onto core/: build/typecheck/ links each package under its
## import name.
TYPECHECK := build/typecheck
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/plugtron
	ln -s $(CURDIR)/core $(TYPECHECK)/plugtron/core
	ln -s $(CURDIR)/core/api $(TYPECHECK)/plugtron/api
	ln -s $(CURDIR)/cli $(TYPECHECK)/plugtron/cli
	ln -s $(CURDIR)/plugins $(TYPECHECK)/plugtron/plugins
	ln -s $(CURDIR)/gpt_plugin/plugtron_gpt $(TYPECHECK)/plugtron_gpt
	ln -s $(CURDIR)/moe_plugin/plugtron_moe $(TYPECHECK)/plugtron_moe
	cd $(TYPECHECK) && MYPYPATH=. $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml \
		--cache-dir $(CURDIR)/build/mypy-cache -p plugtron.core -p plugtron.api -p plugtron.cli \
		-p plugtron.plugins -p plugtron_gpt -p plugtron_moe

clean:
	rm -rf $(VENV) $(BLEND) build *.egg-info gpt_plugin/*.egg-info moe_plugin/*.egg-info
