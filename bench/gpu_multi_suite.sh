#!/usr/bin/env bash
# The multi-GPU tier in one command, for a lent machine with 2, 4 or 8 GPUs (the device
# tool): installs the project offline, runs tests/gpu/test_gpu_tp_engine.py, then
# bench/gpu_tp.py with the given arguments. Logs and JSON land in $OUT.
#   bash bench/gpu_multi_suite.sh                       # test + the 40 GiB benchmark, every TP size that fits
#   bash bench/gpu_multi_suite.sh --tp-sizes 8          # one TP size (8 GPUs: one call per size fits better)
#   bash bench/gpu_multi_suite.sh --bench-only [bench args]
# On 2 H200s with a ~1.7 GB/s disk the whole run takes about 6-7 minutes. Wheels the GPU
# machine lacks travel in .whl/ (protobuf).
set -uo pipefail
OUT=${OUT:-/tmp/weightcache-gpu}
mkdir -p "$OUT"
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
stamp "installing"
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, google.protobuf as p; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'protobuf', p.__version__)"
  df -h /tmp . ; free -g; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
# NVLink multicast stays off, as the machine's notes require.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mode=${1:-}
[ "$mode" = --bench-only ] && shift
if [ "$mode" != --bench-only ]; then
  stamp "tests/gpu/test_gpu_tp_engine.py"
  python3 -m pytest tests/gpu/test_gpu_tp_engine.py -v -p no:cacheprovider -o addopts="-ra" 2>&1 | tee "$OUT/gpu-tp-tests.log"
  stamp "gpu tp tests exit: ${PIPESTATUS[0]}"
fi
# The checkpoint goes on the machine's disk (the checkout), not a RAM-backed /tmp.
stamp "bench/gpu_tp.py $*"
python3 bench/gpu_tp.py --work . --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu-tp-bench.log"
stamp "gpu tp bench exit: ${PIPESTATUS[0]}"
