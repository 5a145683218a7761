# The commands the README, the developers and CI run.
PYTHON ?= python3

.PHONY: install install-demo demo test test-rust test-python lint bench bench-quick gpu-wheel

install-demo:       ## build the extension (release) and install hookloop with what the demo uses
	$(PYTHON) -m pip install -e ".[progress]"

install:            ## build the extension (release) and install hookloop with its test deps
	$(PYTHON) -m pip install -e ".[test]"

demo: install-demo  ## the main job: a demo training run on generated data
	hookloop demo --output output/demo

test: install test-rust test-python   ## everything CI checks

test-rust:
	cargo test -p hookloop-core

test-python:
	$(PYTHON) -m pytest -q

lint:               ## formatting, lints, types, and the stub contract of the extension
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	ruff format --check python tests benches
	ruff check python tests benches
	$(PYTHON) -m mypy python/hookloop
	$(PYTHON) -m mypy.stubtest hookloop._core

bench:              ## overhead benchmarks (figures in docs/performance.md)
	$(PYTHON) benches/bench_overhead.py

bench-quick:
	$(PYTHON) benches/bench_overhead.py --quick

# The offline GPU machine's Python (3.12 there): a pyenv one when there is (its python3.12 shim
# fails unless 3.12 is selected), else python3.12 on PATH. How the wheel is used:
# scripts/gpu_check.sh.
GPU_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)

gpu-wheel:          ## a release wheel in .gpu-wheel/ for the GPU machine (no Rust there)
	rm -rf .gpu-wheel
	maturin build --release -i $(GPU_PYTHON) -o .gpu-wheel
