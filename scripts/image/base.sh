#!/usr/bin/env bash
# A stand-in for the Dockerfile's base image (python:3.11-slim) where public container registries are
# out of reach: Debian bookworm with Python 3.11 and venv, made by debootstrap from the Debian mirror
# and imported into podman's store under the FROM name. Does nothing when that name already exists.
set -euo pipefail
name=${BASE_IMAGE:-docker.io/library/python:3.11-slim}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if podman image exists "$name"; then
  echo "base image $name is there"
  exit 0
fi
root=$(mktemp -d /var/tmp/longdoc-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "building a stand-in for $name with debootstrap (a few minutes)"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >/dev/null
# python:3.11-slim answers to `python`; Debian's interpreter is python3
ln -s /usr/bin/python3 "$root/usr/local/bin/python"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
tar -C "$root" --numeric-owner -c . | podman import --change 'CMD ["python3"]' - "$name" >/dev/null
echo "base image $name built: $(podman image inspect --format '{{.Size}}' "$name") bytes"
