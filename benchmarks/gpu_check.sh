#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU, from the repository root:
#   the tests marked gpu, the default test suite under that machine's torch/transformers,
#   benchmarks/gpu_speed.py, padded against packed micro-batches (benchmarks/packing.py, the
#   long-tailed batch at ~25M, device memory), and with two GPUs or more context parallel 2
#   against 1 over NCCL (benchmarks/context_parallel.py). Logs go to $1 (default gpu-check/).
set -uo pipefail
out="${1:-gpu-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
$py -c 'import torch, transformers; print("torch", torch.__version__, "transformers",
transformers.__version__, torch.cuda.get_device_name())' 2>&1 | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$out/env.txt"
$py -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || echo "editable install failed (see install.log)"
timeout 300 $py -m pytest -q -p no:cacheprovider -n 0 -m gpu --durations=0 tests/test_gpu.py 2>&1 \
  | tee "$out/gpu_tests.log" | tail -20
timeout 300 $py -m pytest -q -p no:cacheprovider -m "not gpu" -n 12 tests 2>&1 \
  | tee "$out/suite.log" | tail -20
timeout 300 $py benchmarks/gpu_speed.py 2>&1 | grep -v "Loading weights" \
  | tee "$out/gpu_speed.log"
timeout 240 $py benchmarks/packing.py --device cuda --examples 16 --max_len 4096 \
  --median 512 --sigma 1.0 --repeats 3 2>&1 | tee "$out/packing.log" | tail -6
if [ "$(nvidia-smi --list-gpus 2>/dev/null | wc -l)" -ge 2 ]; then
  timeout 240 $py benchmarks/context_parallel.py --device cuda --length 16384 2>&1 \
    | tee "$out/context_parallel.log" | tail -8
fi
