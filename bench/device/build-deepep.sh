#!/bin/bash
# Build DeepEP on the lent GPU machine, from the source that travels with the working tree.
#
# Here, once:   bash bench/device/fetch-deepep.sh        # -> .deps/DeepEP (git-ignored)
# Device call:  carry [".whl", ".deps/DeepEP"];  bash bench/device/run.sh x
#               (or alone: bash bench/device/build-deepep.sh)
#
# What it does, and why each step (the recipe of DeepEP V1's README and setup.py, with what
# CUDA 13 needs):
# - nvcc from the image (CUDA_HOME = nvcc's prefix); TORCH_CUDA_ARCH_LIST=9.0 (H200 = sm_90,
#   DeepEP's SM90 paths: TMA, its PTX tricks stay off, DISABLE_AGGRESSIVE_PTX_INSTRS=1 default);
# - NVSHMEM from the image's nvidia-nvshmem-cu13 wheel: setup.py finds `nvidia.nvshmem` itself
#   and links its versioned libnvshmem_host.so.N (NVSHMEM_DIR is left unset on purpose: given
#   NVSHMEM_DIR, setup.py links the unversioned libnvshmem_host.so, which wheels do not ship);
# - CUDA 13 moved CCCL (cuda/std/*, included by NVSHMEM's headers) under include/cccl: the
#   build copy's include_dirs gets $CUDA_HOME/include/cccl (what vLLM's DeepEP build patches);
# - ninja from .whl/pd when the image has none (parallel compiles: MAX_JOBS = cores);
# - DEEPEP_NVSHMEM=auto (default): the NVSHMEM build first; if it fails, the intranode-only
#   build (setup.py's no-NVSHMEM mode, -DDISABLE_NVSHMEM): EP=2 on one node needs only the
#   intranode NVLink kernels. DEEPEP_NVSHMEM=on / off forces one.
# Output: .deps/deepep-build/{deep_ep/, deep_ep_cpp*.so} (PYTHONPATH it; kept on the warm
# machine between calls), a copy in $OUT/deepep-build, the log in $OUT/deepep-build.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
SRC=$REPO/.deps/DeepEP
DEST=$REPO/.deps/deepep-build
OUT=${OUT:-/tmp/deepep-out}
LOG=$OUT/deepep-build.log
MODE=${DEEPEP_NVSHMEM:-auto}
mkdir -p "$OUT"
if [[ ! -f $SRC/setup.py ]]; then
  echo "no DeepEP source in .deps/DeepEP: run bench/device/fetch-deepep.sh on the dev machine and" \
       "carry .deps/DeepEP" | tee "$LOG"
  exit 2
fi
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
export PATH=$CUDA_HOME/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-$(nproc)}
if ! command -v ninja >/dev/null; then  # the ninja wheel's binary, extracted by run.sh
  for bin in /tmp/deps/ninja-*.data/scripts/ninja /tmp/deps/ninja/data/bin/ninja; do
    [[ -f $bin ]] && chmod +x "$bin" && export PATH=$(dirname "$bin"):$PATH
  done
fi
NVSHMEM=$(python3 -c "import importlib.util as u; s = u.find_spec('nvidia.nvshmem'); \
print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')" 2>/dev/null)
{
  echo "== $(date -u +%FT%TZ) DeepEP $(cat "$SRC/COMMIT" 2>/dev/null), mode $MODE"
  nvcc --version | tail -2
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "nvshmem wheel: ${NVSHMEM:-none}"; [[ -n $NVSHMEM ]] && ls "$NVSHMEM/lib"
  echo "ninja: $(command -v ninja || echo none), MAX_JOBS=$MAX_JOBS"
  ls -d "$CUDA_HOME/include/cccl" 2>&1
} >> "$LOG" 2>&1

build() {  # $1: nvshmem | intranode
  local work=/tmp/deepep-src
  rm -rf "$work" && cp -r "$SRC" "$work" && cd "$work" || return 1
  sed -i "s|include_dirs = \['csrc/'\]|include_dirs = ['csrc/', '$CUDA_HOME/include/cccl']|" setup.py
  grep -q "include/cccl" setup.py || echo "warning: include_dirs not patched (setup.py changed?)"
  echo "== build: $1 ($(date -u +%T))"
  if [[ $1 == nvshmem ]]; then
    [[ -n $NVSHMEM ]] || { echo "no nvidia.nvshmem wheel in this image"; return 1; }
    timeout "${BUILD_TIMEOUT_S:-480}" python3 setup.py build_ext --inplace || return 1
  else  # setup.py disables NVSHMEM when it cannot find it: hide the wheel from it
    timeout "${BUILD_TIMEOUT_S:-480}" python3 -c "
import importlib.util, sys
find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == 'nvidia.nvshmem' else find(name, *a)
sys.argv = ['setup.py', 'build_ext', '--inplace']
exec(compile(open('setup.py').read(), 'setup.py', 'exec'))" || return 1
  fi
  rm -rf "$DEST" && mkdir -p "$DEST" && cp -r deep_ep "$DEST/" && cp deep_ep_cpp*.so "$DEST/" || return 1
  echo "$1" > "$DEST/BUILD"
  cd "$REPO" && PYTHONPATH=$DEST:${PYTHONPATH:-} python3 -c "
import deep_ep, deep_ep_cpp
print('deep_ep imports:', deep_ep.Buffer.__name__, 'sm90 compiled:', deep_ep.Buffer.is_sm90_compiled())"
}

status=1
if [[ $MODE != off ]]; then
  build nvshmem >> "$LOG" 2>&1 && status=0
fi
if [[ $status != 0 && $MODE != on ]]; then
  build intranode >> "$LOG" 2>&1 && status=0
fi
cd "$REPO"
if [[ $status == 0 ]]; then
  echo "deepep build: OK ($(cat "$DEST/BUILD")), $(du -sh "$DEST" | cut -f1) in .deps/deepep-build" \
    | tee -a "$LOG"
  rm -rf "$OUT/deepep-build" && cp -r "$DEST" "$OUT/deepep-build"
else
  echo "deepep build: FAILED (mode $MODE); the log: $LOG" | tee -a "$LOG"
fi
grep -E "error|Error|FAILED" "$LOG" | head -20
exit $status
