#!/bin/sh
# Fill docker/wheelhouse/ with every wheel the image needs, on a machine that reaches the package
# indexes, so that a site without them builds with `--build-arg PIP_NO_INDEX=1` (docker/README.md,
# "Building without the public internet"). pip runs inside BASE_IMAGE, so the wheels fit the image's
# Python; sdists (deepspeed, antlr4's runtime) are built into wheels here.
#   docker/wheelhouse.sh cpu|gpu [BASE_IMAGE]      default BASE_IMAGE: the Dockerfile's
# Environment: TORCH_INDEX_URL (default: the Dockerfile's; a torch-2.13.0 wheel already in the
# wheelhouse is used as it is), PIP_CA (a CA bundle for pip; default: this machine's pip `cert`),
# WHEELHOUSE (default docker/wheelhouse), PIP (this machine's pip, default `python3 -m pip`).
set -eu
kind=${1:?usage: docker/wheelhouse.sh cpu|gpu [BASE_IMAGE]}
case $kind in cpu|gpu) ;; *) echo "docker/wheelhouse.sh: KIND is cpu or gpu, not '$kind'" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
dockerfile=docker/Dockerfile.$kind
base=${2:-$(sed -n 's/^ARG BASE_IMAGE=//p' "$dockerfile" | head -n 1)}
torch_index=${TORCH_INDEX_URL-$(sed -n 's/^ARG TORCH_INDEX_URL=//p' "$dockerfile" | head -n 1)}
wheelhouse=${WHEELHOUSE:-docker/wheelhouse}
ca=${PIP_CA-${PIP_CERT:-$(${PIP:-python3 -m pip} config list 2>/dev/null | sed -n "s/^[a-z:]*\.cert='\(.*\)'$/\1/p" | head -n 1)}}
mkdir -p "$wheelhouse"
wheelhouse=$(cd "$wheelhouse" && pwd)
ca_mount=""
if [ -n "$ca" ]; then ca_mount="-v $(readlink -f "$ca"):/run/pip_ca.crt:ro"; fi
ls "$wheelhouse"/torch-2.13.0*.whl >/dev/null 2>&1 && torch_index=skip
# An index that does not answer would only show as pip's retries and "no matching distribution": say what to do.
if [ -n "$torch_index" ] && [ "$torch_index" != skip ] && ! python3 docker/index_answers.py "$torch_index" "$ca" >&2; then
    echo "docker/wheelhouse.sh: the torch index does not answer; put the torch==2.13.0 wheel for the base image's Python into $wheelhouse first" \
         "(make docker-cpu puts the CPU wheel this machine's pip resolves there when the index does not answer)," \
         "or set TORCH_INDEX_URL (empty: pip's configured index)" >&2
    exit 1
fi
echo "wheelhouse: $wheelhouse for $base (torch: ${torch_index:-the configured index})"
# shellcheck disable=SC2086  # ca_mount is empty or two words
docker run --rm --network host --user 0 --entrypoint sh $ca_mount -v "$PWD:/src:ro" -v "$wheelhouse:/wh" \
    -e TORCH_INDEX="$torch_index" -e KIND="$kind" -e OWNER="$(id -u):$(id -g)" "$base" -euc '
    [ -f /run/pip_ca.crt ] && export PIP_CERT=/run/pip_ca.crt
    export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install -q --upgrade pip
    pip="/tmp/venv/bin/pip wheel -q --wheel-dir /wh --find-links /wh"
    $pip pip setuptools wheel     # the Dockerfile upgrades pip; building raygrpo (editable) needs the rest
    if [ "$TORCH_INDEX" != skip ]; then $pip ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==2.13.0"; fi
    mkdir /tmp/src && cp -r /src/setup.py /src/actors /src/learner /src/cluster /tmp/src/
    $pip "/tmp/src[$KIND]"
    rm -f /wh/raygrpo-*.whl       # raygrpo itself is installed from the source
    chown -R "$OWNER" /wh'
echo "wheelhouse: $(ls "$wheelhouse"/*.whl | wc -l) wheels, $(du -sh "$wheelhouse" | cut -f1)"
