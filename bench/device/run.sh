#!/bin/bash
# One device call each (device tool, carry [".whl"], after bench/device/fetch-wheels.sh):
#   bash bench/device/run.sh a   # pytest -m gpu (one and two GPUs), then bench/gemv.py and bench/gpu.py on GPU 0
#   bash bench/device/run.sh b   # bench/gpu_pd.py: 1P1D vs mono on GPU 0 (cuda_ipc)
# Results land in $OUT (the device tool brings them back).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset PYTORCH_CUDA_ALLOC_CONF
mkdir -p /tmp/deps
python3 -c "import zipfile, glob; [zipfile.ZipFile(w).extractall('/tmp/deps') for w in glob.glob('.whl/pd/*.whl')]"
export PYTHONPATH=/tmp/deps:$PWD
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; nproc; } > "$OUT/env.txt" 2>&1
if [[ $1 == a ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/worker/test_gpu.py tests/worker/test_fused_gpu.py tests/worker/test_gemv_gpu.py \
    tests/worker/test_multi_gpu.py tests/worker/test_overlap.py tests/transfer/test_cuda_ipc.py > "$OUT/gpu_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/gpu_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 bench/gemv.py > "$OUT/gemv_bench.txt" 2>&1
  echo "gemv bench rc=$? at ${SECONDS}s" >> "$OUT/gemv_bench.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 bench/gpu.py > "$OUT/gpu_bench.txt" 2>&1
  echo "bench rc=$? at ${SECONDS}s" >> "$OUT/gpu_bench.txt"
  tail -30 "$OUT/gpu_tests.txt"; cat "$OUT/gemv_bench.txt"; tail -40 "$OUT/gpu_bench.txt"
else
  CUDA_VISIBLE_DEVICES=0 timeout 560 python3 -m bench.gpu_pd --out "$OUT" --deadline-s 540 > "$OUT/gpu_pd.txt" 2>&1
  echo "gpu_pd rc=$? at ${SECONDS}s" >> "$OUT/gpu_pd.txt"
  tail -40 "$OUT/gpu_pd.txt"; cat "$OUT/gpu_pd.md" 2>/dev/null
fi
