#!/usr/bin/env bash
# One device call: the CUDA tests, then bench_gpu, each bounded so the other still runs; everything lands in $OUT.
# Usage on a GPU machine, from the repository root: OUT=/some/dir bash benchmarks/gpu_checks.sh [bench seconds]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-checks}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, lightning; print(torch.__version__, lightning.__version__)"; } 2>&1 | tee "$OUT/env.txt"
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py "tests/test_one_device.py" -k "cuda or test_gpu" 2>&1 | tail -40 | tee "$OUT/tests.txt"
timeout "${1:-110}" python3 -m benchmarks.bench_gpu --sizes gpt2-small --strategies ddp,zero1,zero2,zero3,fsdp \
  --rounds 1 --steps 10 --warmup 3 --out "$OUT/bench.md" --chart "$OUT/gpu.png" 2>&1 | tail -30 | tee "$OUT/bench.txt"
