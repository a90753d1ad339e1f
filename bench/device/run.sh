#!/bin/bash
# One device call each (device tool, carry [".whl"], after bench/device/fetch-wheels.sh):
#   bash bench/device/run.sh a   # pytest -m gpu (one and two GPUs), then bench/gemv.py and bench/gpu.py on GPU 0
#   bash bench/device/run.sh b   # bench/gpu_pd.py: 1P1D vs mono on GPU 0 (cuda_ipc)
#   bash bench/device/run.sh c   # GPT-OSS: its gpu tests, then bench/gpt_oss.py on GPU 0
#   bash bench/device/run.sh d   # Qwen3-Next: its GPU tests, then bench/qwen3_next.py on GPU 0
#   bash bench/device/run.sh e   # DeepSeek-V3: pytest -m gpu tests/worker/test_mla_triton.py, bench/deepseek.py
#   bash bench/device/run.sh f   # FP8 (issue 20): its GPU tests, then bench/fp8.py on GPU 0
#   bash bench/device/run.sh g   # serving path (issue 18): piecewise-graph GPU tests, then
#                                #   bench/served.py (engine vs served mono and 1P1D, B = 16 64 160)
#                                #   with a py-spy profile of the mono worker at B = 160
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
    tests/worker/test_multi_gpu.py tests/worker/test_overlap.py tests/transfer/test_cuda_ipc.py \
    tests/worker/test_gpt_oss_kernels.py > "$OUT/gpu_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/gpu_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 bench/gemv.py > "$OUT/gemv_bench.txt" 2>&1
  echo "gemv bench rc=$? at ${SECONDS}s" >> "$OUT/gemv_bench.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 bench/gpu.py > "$OUT/gpu_bench.txt" 2>&1
  echo "bench rc=$? at ${SECONDS}s" >> "$OUT/gpu_bench.txt"
  tail -30 "$OUT/gpu_tests.txt"; cat "$OUT/gemv_bench.txt"; tail -40 "$OUT/gpu_bench.txt"
elif [[ $1 == c ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/worker/test_gpt_oss_kernels.py > "$OUT/gpt_oss_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/gpt_oss_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 bench/gpt_oss.py > "$OUT/gpt_oss_bench.txt" 2>&1
  echo "bench rc=$? at ${SECONDS}s" >> "$OUT/gpt_oss_bench.txt"
  tail -20 "$OUT/gpt_oss_tests.txt"; cat "$OUT/gpt_oss_bench.txt"
elif [[ $1 == d ]]; then
  TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/worker/test_gated_delta.py \
    tests/worker/test_qwen3_next.py -k "not tp2" > "$OUT/qwen3_next_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/qwen3_next_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 -m bench.qwen3_next > "$OUT/qwen3_next_bench.txt" 2>&1
  echo "bench rc=$? at ${SECONDS}s" >> "$OUT/qwen3_next_bench.txt"
  tail -20 "$OUT/qwen3_next_tests.txt"; cat "$OUT/qwen3_next_bench.txt"
elif [[ $1 == e ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/worker/test_mla_triton.py \
    > "$OUT/mla_gpu_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/mla_gpu_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 bench/deepseek.py > "$OUT/deepseek_bench.txt" 2>&1
  echo "bench rc=$? at ${SECONDS}s" >> "$OUT/deepseek_bench.txt"
  tail -30 "$OUT/mla_gpu_tests.txt"; tail -30 "$OUT/deepseek_bench.txt"
elif [[ $1 == f ]]; then
  timeout 180 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/worker/test_fp8_gpu.py \
    tests/worker/test_gpu.py tests/worker/test_fused_gpu.py tests/worker/test_gemv_gpu.py > "$OUT/fp8_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/fp8_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 bench/fp8.py > "$OUT/fp8_bench.txt" 2>&1
  echo "bench rc=$? at ${SECONDS}s" >> "$OUT/fp8_bench.txt"
  tail -30 "$OUT/fp8_tests.txt"; tail -40 "$OUT/fp8_bench.txt"
elif [[ $1 == g ]]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/worker/test_piecewise.py \
    tests/worker/test_gpu.py > "$OUT/serve_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/serve_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 -m bench.served --out "$OUT" \
    --profile-s 8 > "$OUT/served.txt" 2>&1
  echo "served rc=$? at ${SECONDS}s" >> "$OUT/served.txt"
  tail -20 "$OUT/serve_tests.txt"; tail -30 "$OUT/served.txt"
else
  CUDA_VISIBLE_DEVICES=0 timeout 560 python3 -m bench.gpu_pd --out "$OUT" --deadline-s 540 > "$OUT/gpu_pd.txt" 2>&1
  echo "gpu_pd rc=$? at ${SECONDS}s" >> "$OUT/gpu_pd.txt"
  tail -40 "$OUT/gpu_pd.txt"; cat "$OUT/gpu_pd.md" 2>/dev/null
fi
