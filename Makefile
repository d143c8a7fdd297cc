# Two entry points; both create or reuse .venv/ (scripts/setup_venv.sh) first.
#   make demo   the main job: the beam-search training ablation on the embedded generated demo pair
#               (no download, no GPU; about 20 minutes on 2 idle cores; prints the results table
#               and whether it agrees with README's)
#   make test   the whole test suite, in TEST_WORKERS processes (pytest-xdist; 0: no worker processes);
#               each test file stays in one process (--dist loadfile): its tests share fixtures, run in order
PY := .venv/bin/python
TEST_WORKERS ?= 2

.PHONY: setup demo test bench gpu-check gpu-check-dry-run
setup:
	@bash scripts/setup_venv.sh

demo: setup
	$(PY) -m fairseq_softtopk.cli.main_job

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

bench: setup
	$(PY) scripts/bench/bench_ops.py

# On a GPU machine, after `make setup`: the cuda tests and both benchmarks, one report under
# results/gpu_check/ (scripts/bench/gpu_check.py; meant to take under 10 minutes). The dry run: the same steps on the CPU.
gpu-check: setup
	$(PY) scripts/bench/gpu_check.py

gpu-check-dry-run: setup
	$(PY) scripts/bench/gpu_check.py --dry-run
