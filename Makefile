# Two entry points; both create or reuse .venv/ (scripts/setup_venv.sh) first.
#   make demo   the main job: the beam-search training ablation on the embedded generated demo pair
#               (no download, no GPU; about 12 minutes on this 2-core CPU; prints the results table)
#   make test   the whole test suite
PY := .venv/bin/python

.PHONY: setup demo test bench
setup:
	@bash scripts/setup_venv.sh

demo: setup
	$(PY) scripts/run_main_job.py

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) scripts/bench_ops.py
