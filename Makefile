# The two set-up commands of the README. Both create .venv on a fresh machine.
PY ?= python3
VENV := .venv
ACT := . $(VENV)/bin/activate &&

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(ACT) pip install -q --upgrade pip && pip install -q -r requirements.txt -e .
	touch $@

.PHONY: setup test
setup: $(VENV)/.installed

test: setup
	$(ACT) python -m pytest -q
