#!/usr/bin/env bash
# The checks that need a GPU, as one short script for a lent device machine (CI has none):
# the CUDA-marked tests, and the demo with SimpleTrainer and AMPTrainer (float16) on cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test]"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python3 -m pytest -q -m cuda
hookloop demo --device cuda --iters 3000 --output "${OUT:-/tmp}/demo_cuda"
hookloop demo --device cuda --amp --iters 3000 --output "${OUT:-/tmp}/demo_cuda_amp"
