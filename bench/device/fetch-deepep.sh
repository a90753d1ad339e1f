#!/bin/bash
# DeepEP's source, unpacked into .deps/DeepEP (git-ignored: DeepEP is not committed here), for
# bench/device/build-deepep.sh to build on the lent GPU machine (carry: [".deps/DeepEP"]).
# Run here, once:   bash bench/device/fetch-deepep.sh [GIT_DIR_OR_URL]
#
# The commit is DeepEP's last V1 (NVSHMEM-based, `deep_ep.Buffer` with get_dispatch_layout /
# dispatch / combine: the API worker/model/moe.py calls). V2 (from b306af0) replaced it with a
# JIT-compiled ElasticBuffer on NCCL >= 2.30.4, which the image's torch does not ship.
set -euo pipefail
cd "$(dirname "$0")/../.."
COMMIT=567632dd59810d77b3cc05553df953cc0f779799
SOURCE=${1:-https://github.com/deepseek-ai/DeepEP.git}
if [[ -d "$SOURCE" ]]; then
  GIT_DIR_ARG=(--git-dir "$SOURCE")  # a bare or mirror git directory on this machine
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  git clone --quiet --bare --filter=blob:none "$SOURCE" "$tmp/DeepEP.git"
  GIT_DIR_ARG=(--git-dir "$tmp/DeepEP.git")
fi
rm -rf .deps/DeepEP
mkdir -p .deps/DeepEP
git "${GIT_DIR_ARG[@]}" archive "$COMMIT" | tar -x -C .deps/DeepEP
rm -rf .deps/DeepEP/figures  # 1.2 MB of README images: not needed to build
echo "$COMMIT" > .deps/DeepEP/COMMIT
du -sh .deps/DeepEP
