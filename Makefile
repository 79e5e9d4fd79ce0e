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
