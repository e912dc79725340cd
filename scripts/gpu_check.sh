#!/usr/bin/env bash
# ember on a lent GPU, in at most 10 minutes: the GPU-marked tests, then decode of a
# Qwen3-0.6B-shaped random model against the memory-bandwidth floor, printed as one table.
#
#     bash scripts/gpu_check.sh            # from the repository root
#
# It installs nothing but, where torch lacks CUDA, the CUDA build of torch: on Linux x86_64,
# `pip install torch==2.13.0` from the default index (PyPI) is a CUDA build, and is only tried
# when the machine can reach the index. The table ends the output; docs/benchmarks.md says where
# it goes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
began=$SECONDS

echo "== the device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  || { echo "gpu_check: nvidia-smi found no GPU" >&2; exit 2; }
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: this torch has no CUDA; installing the CUDA build (torch==2.13.0 from PyPI)"
  timeout 300 pip install --quiet torch==2.13.0 \
    || { echo "gpu_check: could not install torch with CUDA (no index reachable?)" >&2; exit 2; }
fi
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"

echo "== GPU-marked tests (tests/gpu)"
tests_status=0
timeout 360 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider || tests_status=$?

echo "== decode against the bandwidth floor (bench/gpu_decode.py)"
timeout 150 python bench/gpu_decode.py --device cuda --batches 1,64 --steps 32

echo "gpu_check: $((SECONDS - began)) s; tests exit status $tests_status"
exit "$tests_status"
