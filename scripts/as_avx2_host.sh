#!/usr/bin/env bash
# Run a command as if this x86-64 host had AVX2 and no AVX-512 or AMX: what the engines choose and
# run on a 2-core AVX2-only host (float32, vLLM's AVX2 kernels, oneDNN and torch held to AVX2), on a
# host that has more. Not that host's speed: the cores stay as fast as they are, only the code paths
# change. Needs root (a private mount namespace); child processes inherit all of it.
#
#   scripts/as_avx2_host.sh .venv/bin/python bench/layerwise_overlap.py
#
# What it changes, for the command and everything it starts:
#   /proc/cpuinfo   bind-mounted over with a copy whose flags lack avx512* and amx* (the project's
#                   own dtype choice, services/engine/args.py, and any other reader of it)
#   torch           reports no AVX-512 or AMX (tests/support/avx2_host/sitecustomize.py), so vLLM
#                   loads vllm._C_AVX2 and runs float32 where it would pick bfloat16
#   ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2
#   TORCHINDUCTOR_CACHE_DIR  a cache of its own: kernels torch.compile built for AVX-512 are found
#                   in the shared one under the same key (vLLM's vocab-parallel embedding then
#                   indexes out of range at TP 2)
set -euo pipefail

if [ $# -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
  exit $(( $# == 0 ? 2 : 0 ))
fi
if [ "${PRFAAS_AS_AVX2_HOST:-}" = 1 ]; then
  exec "$@"  # already under it (a test of this script in a suite run under it): nothing to add
fi
if [ "$(id -u)" != 0 ]; then
  echo "as_avx2_host: needs root (a private mount namespace for /proc/cpuinfo)" >&2
  exit 1
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root/tests/support/avx2_host${PYTHONPATH:+:$PYTHONPATH}"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 PRFAAS_AS_AVX2_HOST=1
export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/torchinductor_$(id -un)_as_avx2_host"
exec unshare --mount --propagation private -- bash -c '
  set -euo pipefail
  copy="$(mktemp /tmp/prfaas-cpuinfo.XXXXXX)"
  sed -E "/^flags/ s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*)//g" /proc/cpuinfo >"$copy"
  mount --bind "$copy" /proc/cpuinfo
  rm -f "$copy"
  exec "$@"' as_avx2_host "$@"
