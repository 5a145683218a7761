# The commands the README, the developers and CI run.
PYTHON ?= python3

.PHONY: install install-demo demo test test-rust test-python lint bench bench-quick

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
