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

# baselines against FBT models on CPU (language modelling, state tracking), about 11 minutes on 2 cores;
# longer: make demo DEMO_ARGS="--train-iters 3000 --twice-tokens"
demo: setup
	$(ACT) python tools/demo.py $(DEMO_ARGS)

test: setup
	$(ACT) python -m pytest -q

# ---- serving with vLLM (docs/serving.md): vLLM's CPU build in .venv, transformers within its range
.PHONY: serve-setup
serve-setup: $(VENV)/.serve-installed
$(VENV)/.serve-installed: $(VENV)/.installed requirements-serve.txt
	$(ACT) pip install -q -r requirements-serve.txt && pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@
