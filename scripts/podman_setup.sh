#!/usr/bin/env bash
# Make this machine able to build and run the PrfaaS image with podman: install podman, buildah,
# debootstrap and runc (as root on Debian, when one is missing), and let runc start containers
# where setting rlimits is not permitted (a containers.conf.d drop-in with `default_ulimits = []`).
# Used by scripts/bootstrap.sh and scripts/build_image.sh; safe to run again. Prints what it changes.
set -euo pipefail

missing=()
for tool in podman:podman buildah:buildah debootstrap:debootstrap runc:runc; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "podman-setup: installing ${missing[*]} (container image build and test)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "podman-setup: ${missing[*]} not installed; install them to build the image" >&2
    exit 1
  fi
fi

# crun (podman's default) fails on hosts with hybrid cgroups, and runc fails where containers may
# not set rlimits: the image is built and run with `--runtime runc` and no default ulimits.
dropin=/etc/containers/containers.conf.d/prfaas-ulimits.conf
if [ "$(id -u)" = 0 ] && ! grep -qs 'default_ulimits' /etc/containers/containers.conf.d/*.conf; then
  mkdir -p "$(dirname "$dropin")"
  printf '[containers]\ndefault_ulimits = []\n' >"$dropin"
  echo "podman-setup: wrote $dropin (default_ulimits = [])"
fi
