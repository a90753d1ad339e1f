#!/usr/bin/env bash
# System packages the project needs beyond PyPI: libibverbs1 for Mooncake (without its
# recommended ibverbs-providers, which makes every NIXL/UCX process segfault at exit), and
# Slurm + munge for the local two-node Slurm tests. Idempotent; a no-op when all are present.
set -euo pipefail
need=()
# Mooncake's engine links libibverbs, libnuma and libcurl from the system (a Debian 12 image
# has none of them; tests/deploy/test_image.py checks the list against its NEEDED entries).
for pair in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
  lib=${pair%%:*}
  [[ -e /usr/lib/x86_64-linux-gnu/$lib || -e /usr/lib/aarch64-linux-gnu/$lib ]] || need+=("${pair#*:}")
done
for b in slurmctld slurmd srun munged; do command -v "$b" >/dev/null || { need+=(slurmctld slurmd slurm-client munge); break; }; done
command -v ip >/dev/null || need+=(iproute2)
((${#need[@]})) || exit 0
if [[ $(id -u) != 0 ]]; then
  echo "missing system packages (${need[*]}); install them as root: apt-get install --no-install-recommends ${need[*]}" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update -qq
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# ibverbs-providers breaks NIXL on CPU machines (two libibverbs copies): make sure it is absent
# there. A GPU node (DEVICE=cuda, from `make install`) keeps it: its RDMA NICs need the
# provider (mlx5 and others) for Mooncake's `rdma` protocol.
if [[ ${DEVICE:-cpu} != cuda ]] && dpkg -s ibverbs-providers >/dev/null 2>&1; then
  apt-get remove -y -qq ibverbs-providers >/dev/null
fi
