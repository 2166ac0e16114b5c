#!/usr/bin/env bash
# One device call: bench_gpu's table, then a profile of ddp, zero3 and fsdp, then the CUDA tests, each bounded so the
# next still runs; everything lands in $OUT.
# Usage on a GPU machine, from the repository root: OUT=/some/dir bash benchmarks/gpu_checks.sh [bench seconds]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-checks}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, lightning; print(torch.__version__, lightning.__version__)"; git log -1 --format=%h 2>/dev/null; } 2>&1 | tee "$OUT/bench.txt"
timeout "${1:-240}" python3 -m benchmarks.bench_gpu --sizes gpt2-small --strategies ddp,zero1,zero2,zero3,fsdp \
  --rounds 1 --steps 10 --warmup 3 --run-timeout 90 --out "$OUT/bench.md" --chart "$OUT/gpu.png" 2>&1 | tee -a "$OUT/bench.txt" | tail -30
# the profiler slows the steps it records: its own runs, not the table's
timeout 120 python3 -m benchmarks.bench_gpu --sizes gpt2-small --strategies ddp,zero3,fsdp --rounds 1 --steps 3 \
  --warmup 3 --run-timeout 60 --profile "$OUT/profile" 2>&1 | tail -8
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py "tests/test_one_device.py" -k "cuda or test_gpu" 2>&1 | tee "$OUT/tests.txt" | tail -25
