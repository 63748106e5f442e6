#!/bin/sh
# Make a base image for the Dockerfile (BASE_IMAGE) and for Redis (KVFLEET_REDIS_IMAGE) locally,
# from Debian's package mirror alone, for hosts that reach no image registry: Debian bookworm
# (minbase) with Python 3.11 as `python`, its venv module, redis-server and redis-cli.
#
#   sudo deploy/base-image.sh [TAG]          # default TAG: kvfleet-local/bookworm-python:3.11
#
# Needs root, debootstrap and a running Docker engine. Environment:
#   DEBIAN_MIRROR    the mirror debootstrap uses (default http://deb.debian.org/debian)
#   EXTRA_CA_BUNDLE  a PEM file whose certificates the image should trust too (a TLS-intercepting
#                    proxy's); pip inside the image is pointed at the combined bundle
#   WHEELS_DIR       wheels to copy into the image's /opt/wheels, which pip then searches first
#                    (e.g. a torch build when the torch index is not reachable)
set -eu
TAG=${1:-kvfleet-local/bookworm-python:3.11}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOTFS=$(mktemp -d /tmp/kvfleet-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,redis-server,redis-tools \
    bookworm "$ROOTFS" "$MIRROR"
ln -sf python3 "$ROOTFS/usr/bin/python"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*

set -- -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
       -c 'CMD ["python"]'
if [ -n "${EXTRA_CA_BUNDLE:-}" ]; then
    cp "$EXTRA_CA_BUNDLE" "$ROOTFS/usr/local/share/ca-certificates/extra-ca.crt"
    # update-ca-certificates takes one certificate per file: split the bundle.
    (cd "$ROOTFS/usr/local/share/ca-certificates" && \
        awk '/BEGIN CERT/{n++} {print > ("extra-" n ".crt")}' extra-ca.crt && rm extra-ca.crt)
    chroot "$ROOTFS" update-ca-certificates >/dev/null
    set -- "$@" -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt'
fi
if [ -n "${WHEELS_DIR:-}" ]; then
    mkdir -p "$ROOTFS/opt/wheels"
    cp "$WHEELS_DIR"/*.whl "$ROOTFS/opt/wheels/"
    set -- "$@" -c 'ENV PIP_FIND_LINKS=/opt/wheels'
fi
tar -C "$ROOTFS" -c . | docker import "$@" - "$TAG"
echo "$TAG"
