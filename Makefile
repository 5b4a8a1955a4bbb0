# The two commands of the README. Each installs what it needs first.
PY := .venv/bin/python

.PHONY: demo test setup clean

setup:
	@bash scripts/bootstrap.sh

demo: setup
	@$(PY) -m testbed.cli demo

test: setup
	@$(PY) -m pytest -q tests

clean: setup
	@$(PY) -m testbed.cli clean
