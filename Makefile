# Two entry points; both create or reuse .venv/ (scripts/setup_venv.sh) first.
#   make demo   the main job on the embedded generated corpus (no download, no GPU)
#   make test   the whole test suite
PY := .venv/bin/python

.PHONY: setup demo test bench
setup:
	@bash scripts/setup_venv.sh

demo: setup
	$(PY) scripts/run_demo.py

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) scripts/bench_ops.py
