#!/usr/bin/env bash
# The checks that need a GPU, as one short script for a lent device machine (CI has none):
# the CUDA-marked tests, the demo with SimpleTrainer and AMPTrainer (float16) on cuda, and
# benches/gpu_check.py (syncs on non-write iterations; the tiny MLP's steps/s on cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test]"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python3 -m pytest -q -m cuda
hookloop demo --device cuda --iters 3000 --output "${OUT:-/tmp}/demo_cuda"
hookloop demo --device cuda --amp --iters 3000 --output "${OUT:-/tmp}/demo_cuda_amp"
# the sync checks and steps/s (issues 11, 26); it exits 1 when a non-write iteration
# synchronized or the seeds' stack (every iteration read) made other than one transfer per
# iteration, after printing its whole report
python3 benches/gpu_check.py --json "${OUT:-/tmp}/gpu_check.json"
