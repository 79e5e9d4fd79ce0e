# The two set-up commands of the README. Both create .venv on a fresh machine.
PY ?= python3
VENV := .venv
ACT := . $(VENV)/bin/activate &&

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(ACT) pip install -q --upgrade pip && pip install -q -r requirements.txt -e .
	touch $@

.PHONY: setup demo test
setup: $(VENV)/.installed

# baselines against FBT models on CPU (compute for data, state tracking; only what held in every seed of
# docs/evidence.md), about 11 minutes on 2 cores; the studies' grids behind it: make demo DEMO_ARGS=--full
demo: setup
	$(ACT) python tools/demo.py $(DEMO_ARGS)

test: setup
	$(ACT) python -m pytest -q

# ---- serving with vLLM (docs/serving.md): a second environment, .venv-serve, with vLLM's CPU build
# and transformers within vLLM's range (<5.20); .venv keeps the newest transformers.
SERVE_VENV := .venv-serve
.PHONY: serve-setup test-serve
serve-setup: $(SERVE_VENV)/.installed
$(SERVE_VENV)/.installed: requirements.txt requirements-serve.txt pyproject.toml
	$(PY) -m venv $(SERVE_VENV)
	. $(SERVE_VENV)/bin/activate && pip install -q --upgrade pip && pip install -q -r requirements.txt -r requirements-serve.txt -e . \
		&& pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-serve: serve-setup
	. $(SERVE_VENV)/bin/activate && FBT_REQUIRE_VLLM=1 python -m pytest -q tests/test_serving.py
