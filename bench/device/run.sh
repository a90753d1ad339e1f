#!/bin/bash
# One device call each (device tool, carry [".whl"], after bench/device/fetch-wheels.sh):
#   bash bench/device/run.sh a   # pytest -m gpu (one and two GPUs), then bench/gemv.py and bench/gpu.py on GPU 0
#   bash bench/device/run.sh b   # bench/gpu_pd.py: 1P1D vs mono on GPU 0 (cuda_ipc)
#   bash bench/device/run.sh c   # GPT-OSS: its gpu tests, then bench/gpt_oss.py on GPU 0
#   bash bench/device/run.sh d   # Qwen3-Next: its GPU tests, then bench/qwen3_next.py on GPU 0
#   bash bench/device/run.sh e   # DeepSeek-V3: pytest -m gpu tests/worker/test_mla_triton.py, bench/deepseek.py
#   bash bench/device/run.sh h   # figures of issues 16 and 20: bench/fp8.py, deepseek.py, qwen3_next.py, gpt_oss.py
#   bash bench/device/run.sh t   # every gpu-marked test (all families, FP8, grammar, graphs), one list
#   bash bench/device/run.sh s   # issue 19: bench/pd_vs_mono.py, 1P1D vs mono sweep, 8B shape
#   bash bench/device/run.sh q   # bench/fp8.py, then bench.served B = 64 160 + profile
#   bash bench/device/run.sh r [SECTIONS]  # FP8 kernels (issue 20): their GPU tests (FP8,
#                                #   fused FP8 activations, split-K, GEMV, MLA), the FP8 GEMV
#                                #   sweep and chain (bench/gemv.py --fp8 --sweep), then
#                                #   bench/fp8.py SECTIONS (default: all)
#   bash bench/device/run.sh f   # FP8 (issue 20): its GPU tests (and the decode kernels' and
#                                #   MLA's), bench/gemv.py --fp8, then all of bench/fp8.py
#   bash bench/device/run.sh w   # bench/gpu.py decode rates, then bench.served B = 64 160 + profile
#   bash bench/device/run.sh v   # serving path (issue 18): piecewise-graph GPU tests, then
#                                #   bench/served.py (engine vs served mono and 1P1D, B = 16 64 160)
#                                #   with a py-spy profile of the mono worker at B = 160
#   bash bench/device/run.sh o   # serving path (issue 18): mixed-step attention GPU tests and
#                                #   bench/mixed_attention.py, then bench/served.py B = 64 160
#                                #   and py-spy of the mono worker and its gateway; `o "" K=V`
#                                #   adds a second served run with that override
#   bash bench/device/run.sh u [ARGS [K=V]]  # GPU tests of the mixed-step, graph-fill, FP8 and
#                                #   speculative paths, then bench/served.py at B = 160 (engine
#                                #   step times) with ARGS, e.g. "--range-ratio 0.5 --waves 4";
#                                #   K=V: a second served run with that override
#   bash bench/device/run.sh n [sweep]  # split-K FP8 GEMM (issue 20): its GPU tests and the FP8
#                                #   ones (GEMV, fused activations), bench/fp8_splitk.py, bench/fp8.py decode (split-K vs
#                                #   the dispatch before it), then with `sweep` its tile sweep
#   bash bench/device/run.sh i [--check [SECTIONS]]  # the decode kernel at long context
#                                #   (issue 20): bench/decode_kernel.py (its settings at 32k,
#                                #   graph-timed; --check: the attention GPU tests first, then
#                                #   the engine's settings against the ones before), then
#                                #   bench/fp8.py SECTIONS (default: ceilings,longctx)
#   bash bench/device/run.sh l [B,B [CONFIGS]]  # served / engine as a user measures it
#                                #   (issue 18): `tandem bench --config configs/gpu-8b-X.yaml`
#                                #   for X in CONFIGS (default "mono 1p1d"; 1P1D's two workers
#                                #   on GPU 0) on the 8B shape (dummy bf16, ids prompts, 128 in /
#                                #   256 out +-50%; REQUESTS=N: N a point, default 480)
#   bash bench/device/run.sh k   # speculative decoding (issue 21): its GPU tests (verify
#                                #   graphs), then bench/spec_gpu.py on GPU 0 (bench/spec-cpu.json)
# Results land in $OUT (the device tool brings them back).
# Issue 23 (g on one GPU or two; m, p and y need two GPUs: nvidia-h200-x2):
#   bash bench/device/run.sh g   # cuda_ipc gather + static MoE GPU tests, bench/page_gather.py
#   bash bench/device/run.sh m   # multi-GPU tests (TP/DP/EP, eager and graphs), bench/tp_gpu.py
#   bash bench/device/run.sh p   # bench/gpu_pd.py --placement two-gpus (1P1D GPU0->GPU1 vs DP=2)
#   bash bench/device/run.sh x   # build DeepEP (carry .deps/DeepEP too), then y if time is left
#   bash bench/device/run.sh y   # DeepEP EP=2 vs the torch all-to-all (after x on this machine)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset PYTORCH_CUDA_ALLOC_CONF
mkdir -p /tmp/deps
python3 -c "import zipfile, glob; [zipfile.ZipFile(w).extractall('/tmp/deps') for w in glob.glob('.whl/pd/*.whl')]"
export PYTHONPATH=/tmp/deps:$PWD
# Wheels' scripts (py-spy's binary) land under <name>.data/scripts when a wheel is unzipped.
for d in /tmp/deps/*.data/scripts; do [[ -d $d ]] && chmod +x "$d"/* && export PATH=$d:$PATH; done
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; nproc; } > "$OUT/env.txt" 2>&1
if [[ $1 == h ]]; then
  run() {  # name, seconds, command...: each bench bounded, its output kept whatever happens
    local name=$1 secs=$2; shift 2
    CUDA_VISIBLE_DEVICES=0 timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
    echo "$name rc=$? at ${SECONDS}s" | tee -a "$OUT/$name.txt"
  }
  run fp8 230 python3 bench/fp8.py
  run deepseek 110 python3 bench/deepseek.py
  run qwen3_next 100 python3 -m bench.qwen3_next
  run gpt_oss $((570 - SECONDS)) python3 bench/gpt_oss.py
  tail -n 25 "$OUT"/fp8.txt "$OUT"/deepseek.txt "$OUT"/qwen3_next.txt "$OUT"/gpt_oss.txt
elif [[ $1 == t ]]; then
  timeout ${2:-500} python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/worker tests/transfer --timeout 240 \
    > "$OUT/gpu_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/gpu_tests.txt"
  grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.txt" | tail -40
elif [[ $1 == a ]]; then
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
    tests/worker/test_gpu.py tests/worker/test_fused_gpu.py tests/worker/test_gemv_gpu.py \
    tests/worker/test_mla_triton.py > "$OUT/fp8_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/fp8_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 bench/gemv.py --fp8 > "$OUT/gemv_fp8.txt" 2>&1
  echo "gemv fp8 rc=$? at ${SECONDS}s" >> "$OUT/gemv_fp8.txt"
  cat "$OUT/gemv_fp8.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 bench/fp8.py > "$OUT/fp8_bench.txt" 2>&1
  echo "bench rc=$? at ${SECONDS}s" >> "$OUT/fp8_bench.txt"
  tail -30 "$OUT/fp8_tests.txt"; tail -40 "$OUT/fp8_bench.txt"
elif [[ $1 == g ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/transfer/test_cuda_ipc.py \
    tests/transfer/test_page_gather.py tests/worker/test_moe_static.py > "$OUT/gather_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/gather_tests.txt"
  timeout $((575 - SECONDS)) python3 bench/page_gather.py --out "$OUT" > "$OUT/page_gather.txt" 2>&1
  echo "page_gather rc=$? at ${SECONDS}s" >> "$OUT/page_gather.txt"
  tail -20 "$OUT/gather_tests.txt"; tail -5 "$OUT/page_gather.txt"; cat "$OUT/page_gather.md"
elif [[ $1 == m ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/worker/test_multi_gpu.py \
    tests/worker/test_moe_static.py > "$OUT/multi_gpu_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/multi_gpu_tests.txt"
  timeout $((575 - SECONDS)) python3 bench/tp_gpu.py --out "$OUT" > "$OUT/tp_gpu.txt" 2>&1
  echo "tp_gpu rc=$? at ${SECONDS}s" >> "$OUT/tp_gpu.txt"
  tail -20 "$OUT/multi_gpu_tests.txt"; tail -5 "$OUT/tp_gpu.txt"; cat "$OUT/tp_gpu.md"
elif [[ $1 == p ]]; then
  timeout 560 python3 -m bench.gpu_pd --placement two-gpus --out "$OUT" --deadline-s 540 \
    > "$OUT/gpu_pd.txt" 2>&1
  echo "gpu_pd rc=$? at ${SECONDS}s" >> "$OUT/gpu_pd.txt"
  tail -40 "$OUT/gpu_pd.txt"; cat "$OUT/gpu_pd.md" 2>/dev/null
elif [[ $1 == x || $1 == y ]]; then
  if [[ $1 == x ]]; then
    bash bench/device/build-deepep.sh; echo "build rc=$? at ${SECONDS}s"
  fi
  if [[ -d .deps/deepep-build && ( $1 == y || SECONDS -lt 360 ) ]]; then
    PYTHONPATH=$PWD/.deps/deepep-build:$PYTHONPATH timeout $((580 - SECONDS)) python3 -m pytest \
      -q -s -p no:cacheprovider -rfE -m gpu tests/worker/test_deepep_gpu.py > "$OUT/deepep_tests.txt" 2>&1
    echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/deepep_tests.txt"
    tail -30 "$OUT/deepep_tests.txt"
  fi
elif [[ $1 == s ]]; then
  # Both workers on GPU 0 (one H200): cuda_ipc within the GPU; 8B-shape dummy weights.
  CUDA_VISIBLE_DEVICES=0 timeout 570 python3 -m bench.pd_vs_mono --pd configs/gpu-8b-1p1d.yaml \
    --mono configs/gpu-8b-mono.yaml --model bench/models/qwen3-8b-shape \
    --set model.load_format=dummy --pd-set roles.decode.parallel.device=cuda:0 \
    --pd-set cache.max_total_tokens=131072 --concurrency 1,8,32,64 --num-requests 128 \
    --input-len 1024 --output-len 128 --prompt-kind ids --vocab-size 151936 \
    --out "$OUT/bench-h200" > "$OUT/pd_vs_mono.txt" 2>&1
  echo "pd_vs_mono rc=$? at ${SECONDS}s" >> "$OUT/pd_vs_mono.txt"
  tail -20 "$OUT/pd_vs_mono.txt"
elif [[ $1 == v ]]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/worker/test_piecewise.py \
    tests/worker/test_gpu.py > "$OUT/serve_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/serve_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 -m bench.served --out "$OUT" \
    --profile-s 8 > "$OUT/served.txt" 2>&1
  echo "served rc=$? at ${SECONDS}s" >> "$OUT/served.txt"
  tail -20 "$OUT/serve_tests.txt"; tail -30 "$OUT/served.txt"
elif [[ $1 == q ]]; then
  # FP8 figures (issue 20), then served / engine at B = 64 and 160 (issue 18) in one call.
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 bench/fp8.py > "$OUT/fp8.txt" 2>&1
  echo "fp8 rc=$? at ${SECONDS}s" >> "$OUT/fp8.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 -m bench.served --out "$OUT" \
    --batches 64,160 --profile-s 8 > "$OUT/served.txt" 2>&1
  echo "served rc=$? at ${SECONDS}s" >> "$OUT/served.txt"
  tail -30 "$OUT/fp8.txt"; tail -8 "$OUT/served.txt"; head -24 "$OUT/worker_profile.txt"
elif [[ $1 == r ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/worker/test_fp8_gpu.py \
    tests/worker/test_fp8_act.py tests/worker/test_fused_gpu.py tests/worker/test_fp8_splitk.py \
    tests/worker/test_gemv_gpu.py tests/worker/test_mla_triton.py > "$OUT/fp8_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/fp8_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 bench/gemv.py --fp8 --sweep > "$OUT/gemv_fp8.txt" 2>&1
  echo "gemv fp8 rc=$? at ${SECONDS}s" >> "$OUT/gemv_fp8.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((580 - SECONDS)) python3 bench/fp8.py \
    --sections ${2:-ceilings,gemm,decode,prefill,room,longctx} > "$OUT/fp8.txt" 2>&1
  echo "fp8 rc=$? at ${SECONDS}s" >> "$OUT/fp8.txt"
  tail -8 "$OUT/fp8_tests.txt"; grep -v "^  " "$OUT/gemv_fp8.txt"; tail -16 "$OUT/fp8.txt"
elif [[ $1 == i ]]; then
  if [[ ${2:-} == --check ]]; then
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/worker/test_fp8_gpu.py \
      tests/worker/test_gpu.py tests/worker/test_mixed_attention.py \
      tests/worker/test_gpt_oss_kernels.py > "$OUT/attn_tests.txt" 2>&1
    echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/attn_tests.txt"
    tail -4 "$OUT/attn_tests.txt"
  fi
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m bench.decode_kernel ${2:-} > "$OUT/decode_kernel.txt" 2>&1
  echo "decode_kernel rc=$? at ${SECONDS}s" >> "$OUT/decode_kernel.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((585 - SECONDS)) python3 bench/fp8.py \
    --sections ${3:-ceilings,longctx} > "$OUT/fp8.txt" 2>&1
  echo "fp8 rc=$? at ${SECONDS}s" >> "$OUT/fp8.txt"
  grep -v Warning "$OUT/decode_kernel.txt"; grep -v "^\[" "$OUT/fp8.txt" | tail -30
elif [[ $1 == w ]]; then
  # Where the engine's time goes at B = 64 / 160: bench/gpu.py's decode rates (its own lengths)
  # beside bench.served's engine, then the served runs with a py-spy profile of the mono worker.
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/gpu.py --sections decode > "$OUT/gpu_decode.txt" 2>&1
  echo "gpu decode rc=$? at ${SECONDS}s" >> "$OUT/gpu_decode.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 -m bench.served --out "$OUT" \
    --batches 64,160 --profile-s 8 > "$OUT/served.txt" 2>&1
  echo "served rc=$? at ${SECONDS}s" >> "$OUT/served.txt"
  tail -8 "$OUT/gpu_decode.txt"; tail -14 "$OUT/served.txt"; head -60 "$OUT/worker_profile.txt"
elif [[ $1 == o ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/worker/test_mixed_attention.py \
    tests/worker/test_piecewise.py tests/worker/test_gpt_oss_kernels.py tests/worker/test_overlap.py \
    > "$OUT/serve_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/serve_tests.txt"
  tail -6 "$OUT/serve_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m bench.mixed_attention > "$OUT/mixed_attention.txt" 2>&1
  echo "mixed_attention rc=$? at ${SECONDS}s" >> "$OUT/mixed_attention.txt"
  cat "$OUT/mixed_attention.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 -m bench.served --out "$OUT" \
    --batches 64,160 --profile-s 8 ${2:-} > "$OUT/served.txt" 2>&1
  echo "served rc=$? at ${SECONDS}s" >> "$OUT/served.txt"
  tail -14 "$OUT/served.txt"; for f in worker gateway client; do head -40 "$OUT/${f}_profile.txt"; done
  if [[ -n ${3:-} ]]; then  # a second run with one more override (its table on stdout only)
    CUDA_VISIBLE_DEVICES=0 timeout $((590 - SECONDS)) python3 -m bench.served --out /tmp/served2 \
      --batches 64,160 --set "$3" > /tmp/served2.txt 2>&1
    echo "served --set $3 rc=$? at ${SECONDS}s"; tail -12 /tmp/served2.txt
  fi
elif [[ $1 == u ]]; then
  # The GPU tests of every engine path a mixed step or a decode-graph fill reaches, then
  # bench.served at B = 160 (engine step times by kind in served.txt) with ARGS ($2); with $3
  # (KEY=VALUE) a second served run with that override too (its table in served2.txt).
  # (TESTS="..." runs those test files instead)
  timeout 330 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu ${TESTS:-tests/worker/test_gpu.py \
    tests/worker/test_fp8_gpu.py tests/worker/test_spec_gpu.py tests/worker/test_fp8_splitk.py \
    tests/worker/test_mixed_attention.py tests/worker/test_piecewise.py tests/worker/test_overlap.py \
    tests/worker/test_gpt_oss_kernels.py tests/worker/test_fused_gpu.py \
    tests/worker/test_mixed_graphs.py} > "$OUT/gpu_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/gpu_tests.txt"
  grep -E "passed|failed|FAILED|ERROR|rc=" "$OUT/gpu_tests.txt" | tail -20
  CUDA_VISIBLE_DEVICES=0 timeout $((585 - SECONDS)) python3 -m bench.served --out "$OUT" \
    --batches 160 ${2:-} > "$OUT/served.txt" 2>&1
  echo "served rc=$? at ${SECONDS}s" >> "$OUT/served.txt"
  grep -E "engine B=|profiled steps|^decode|^mixed" "$OUT/served.txt"; tail -12 "$OUT/served.txt"
  if [[ -n ${3:-} ]]; then
    mkdir -p /tmp/served2
    CUDA_VISIBLE_DEVICES=0 timeout $((590 - SECONDS)) python3 -m bench.served --out /tmp/served2 \
      --batches 160 ${2:-} --set "$3" > "$OUT/served2.txt" 2>&1
    echo "served --set $3 rc=$? at ${SECONDS}s" >> "$OUT/served2.txt"
    grep -E "engine B=|profiled steps|^decode|^mixed" "$OUT/served2.txt"; tail -10 "$OUT/served2.txt"
  fi
elif [[ $1 == l ]]; then
  # each config's served / engine in turn; 1P1D with both workers on GPU 0 (its decode worker's
  # own rate: the served decode column, measured while no prompt runs)
  for config in ${3:-mono 1p1d}; do
    sets=()
    [[ $config == 1p1d ]] && sets=(--set roles.prefill.parallel.device=cuda:0
      --set roles.decode.parallel.device=cuda:0 --set cache.max_total_tokens=131072)
    mkdir -p "$OUT/$config"
    CUDA_VISIBLE_DEVICES=0 timeout $((590 - SECONDS)) python3 -m orchestrator.cli bench \
      --config configs/gpu-8b-$config.yaml --set model.path=bench/models/qwen3-8b-shape \
      --set model.load_format=dummy --set model.max_model_len=4096 \
      --set scheduler.max_num_seqs=160 "${sets[@]}" --prompt-kind ids --vocab-size 151936 \
      --input-len 128 --output-len 256 --range-ratio 0.5 --concurrency "${2:-64,160}" \
      --num-requests ${REQUESTS:-480} --clients 4 --out "$OUT/$config" > "$OUT/$config/bench_engine.txt" 2>&1
    echo "bench --config $config rc=$? at ${SECONDS}s" >> "$OUT/$config/bench_engine.txt"
    tail -8 "$OUT/$config/bench_engine.txt"
  done
elif [[ $1 == k ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/worker/test_spec_gpu.py \
    tests/worker/test_gpu.py > "$OUT/spec_gpu_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/spec_gpu_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 -m bench.spec_gpu \
    --acceptance bench/spec-cpu.json --out "$OUT" > "$OUT/spec_gpu_bench.txt" 2>&1
  echo "bench rc=$? at ${SECONDS}s" >> "$OUT/spec_gpu_bench.txt"
  tail -20 "$OUT/spec_gpu_tests.txt"; cat "$OUT/spec_gpu_bench.txt"
elif [[ $1 == n ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/worker/test_fp8_splitk.py \
    tests/worker/test_fp8_gpu.py tests/worker/test_fp8_act.py tests/worker/test_gemv_gpu.py \
    > "$OUT/splitk_tests.txt" 2>&1
  echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/splitk_tests.txt"
  tail -15 "$OUT/splitk_tests.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/fp8_splitk.py > "$OUT/fp8_splitk.txt" 2>&1
  echo "fp8_splitk rc=$? at ${SECONDS}s" >> "$OUT/fp8_splitk.txt"
  cat "$OUT/fp8_splitk.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 bench/fp8.py --sections ceilings,decode \
    > "$OUT/fp8_bench.txt" 2>&1
  echo "bench rc=$? at ${SECONDS}s" >> "$OUT/fp8_bench.txt"
  tail -14 "$OUT/fp8_bench.txt"
  if [[ ${2:-} == sweep ]]; then  # what time is left: tiles and splits (its files stay there)
    OUT=/tmp CUDA_VISIBLE_DEVICES=0 timeout $((585 - SECONDS)) python3 bench/fp8_splitk.py \
      --sweep > "$OUT/fp8_splitk_sweep.txt" 2>&1
    grep -E "best|rc=" "$OUT/fp8_splitk_sweep.txt"
  fi
else
  CUDA_VISIBLE_DEVICES=0 timeout 560 python3 -m bench.gpu_pd --out "$OUT" --deadline-s 540 > "$OUT/gpu_pd.txt" 2>&1
  echo "gpu_pd rc=$? at ${SECONDS}s" >> "$OUT/gpu_pd.txt"
  tail -40 "$OUT/gpu_pd.txt"; cat "$OUT/gpu_pd.md" 2>/dev/null
fi
