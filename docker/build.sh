#!/usr/bin/env bash
# `make docker-cpu` / `make docker-gpu`: build raygrpo:cpu or raygrpo:gpu with the build arguments
# this machine needs. Each choice is printed with the check that made it:
#   base image  BASE_IMAGE if set; else the Dockerfile's default when it is here or can be pulled;
#               else (cpu) `make docker-base`'s Debian image, built if missing
#   torch       TORCH_INDEX_URL if set (empty: pip's configured index); else the Dockerfile's default
#               index when it answers; else (cpu) pip's configured index plus a wheelhouse holding the
#               CPU torch wheel that this machine's pip resolves
#   CA bundle   PIP_CA if set; else the `cert` of this machine's pip configuration, if any; handed
#               to the build as the secret pip_ca (never stored in the image)
# Usage: docker/build.sh cpu|gpu [more `docker build` options]. Environment: IMAGE (default
# raygrpo:KIND), BASE_IMAGE, TORCH_INDEX_URL, PIP_CA, WHEELHOUSE (a directory inside the repo,
# default docker/wheelhouse), PIP (this machine's pip, default `python3 -m pip`). docker/README.md
# documents every build argument.
set -euo pipefail
kind=${1:?usage: docker/build.sh cpu|gpu [docker build options]}
shift
[[ $kind == cpu || $kind == gpu ]] || { echo "docker/build.sh: KIND is cpu or gpu, not '$kind'" >&2; exit 2; }
cd "$(dirname "$0")/.."
dockerfile=docker/Dockerfile.$kind
image=${IMAGE:-raygrpo:$kind}
wheelhouse=${WHEELHOUSE:-docker/wheelhouse}
read -r -a pip <<< "${PIP:-python3 -m pip}"
say() { echo "docker-$kind: $*"; }
fail() { echo "docker-$kind: error: $*" >&2; exit 2; }
arg_default() { sed -n "s/^ARG $1=//p" "$dockerfile" | head -n 1; }

docker info >/dev/null 2>&1 || fail "no Docker daemon answers (\`docker info\` failed); start one (docker/README.md, 'A daemon')"

# BuildKit: the Dockerfiles mount the CA bundle and the wheelhouse (RUN --mount), which the legacy
# builder cannot. A docker client from 23.0 on builds through the buildx plugin; older ones have
# BuildKit built in (DOCKER_BUILDKIT=1). A client of 23+ without buildx cannot: then try the next
# `docker` on PATH (e.g. Debian's docker.io client behind a newer static one).
build=()
if docker buildx version >/dev/null 2>&1; then
    build=(docker buildx build --load)
else
    while read -r client; do
        version=$("$client" version --format '{{.Client.Version}}' 2>/dev/null || true)
        if [[ $version =~ ^([0-9]+)\. ]] && (( BASH_REMATCH[1] < 23 )); then
            build=(env DOCKER_BUILDKIT=1 "$client" build)
            break
        fi
    done < <(type -ap docker)
    [[ ${#build[@]} -gt 0 ]] || fail "BuildKit is needed and \`docker buildx\` is missing: install the buildx plugin (package docker-buildx or docker-buildx-plugin)"
    [[ ${build[2]} == "$(type -P docker)" ]] || say "\`docker\` ($(type -P docker)) has no buildx; building with ${build[2]} (BuildKit built in, client $version)"
fi

# base image
base=${BASE_IMAGE:-}
if [[ -z $base ]]; then
    base=$(arg_default BASE_IMAGE)
    if docker image inspect "$base" >/dev/null 2>&1; then
        say "base image $base (here)"
    elif out=$(docker pull -q "$base" 2>&1); then
        say "base image $base (pulled)"
    elif [[ $kind == cpu ]]; then
        say "base image $base cannot be pulled ($(tail -n 1 <<< "$out")): using the Debian base of \`make docker-base\`"
        base=raygrpo-base:bookworm
        docker image inspect "$base" >/dev/null 2>&1 || docker/base.sh "$base"
    else
        fail "base image $base cannot be pulled ($(tail -n 1 <<< "$out")); set BASE_IMAGE to a CUDA image your registry has (docker/README.md)"
    fi
else
    say "base image $base (BASE_IMAGE)"
fi

# CA bundle for pip: PIP_CA, else what this machine's pip is configured with (PIP_CERT or `cert`)
ca=${PIP_CA-}
if [[ -z ${PIP_CA+set} ]]; then
    ca=${PIP_CERT:-$("${pip[@]}" config list 2>/dev/null | sed -n "s/^[a-z:]*\.cert='\(.*\)'$/\1/p" | head -n 1)}
fi
secret=()
if [[ -n $ca ]]; then
    [[ -s $ca ]] || fail "CA bundle $ca (PIP_CA or pip's cert) is not a readable file"
    secret=(--secret "id=pip_ca,src=$ca")
    say "pip CA bundle $ca (a build secret)"
fi

# torch: TORCH_INDEX_URL if set; else the Dockerfile's default index if it answers; else (cpu) the
# CPU wheel this machine's pip resolves, put into the wheelhouse, and pip's configured index
args=(--build-arg "BASE_IMAGE=$base" --build-arg "WHEELHOUSE=$wheelhouse")
configured="pip's configured index"
if [[ -n ${TORCH_INDEX_URL+set} ]]; then
    args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
    say "torch from ${TORCH_INDEX_URL:-$configured} (TORCH_INDEX_URL)"
else
    index=$(arg_default TORCH_INDEX_URL)
    if [[ -z $index ]] || python3 docker/index_answers.py "$index" "$ca"; then
        say "torch from ${index:-$configured} (the Dockerfile's default)"
    elif [[ $kind == cpu ]]; then
        # the image's Python decides which wheel fits, not this machine's
        pyver=$(docker run --rm --network host --entrypoint python3 "$base" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
        mkdir -p "$wheelhouse"
        "${pip[@]}" download -q --no-deps --dest "$wheelhouse" --only-binary :all: --python-version "$pyver" \
            --platform manylinux_2_28_x86_64 "torch==2.13.0"
        wheel=$(cd "$wheelhouse" && ls -t torch-2.13.0*-cp"$pyver"-*.whl | head -n 1)
        [[ $wheel == *+cpu* ]] || fail "$index does not answer and the torch wheel this machine's pip resolves ($wheel) is not a CPU build: set TORCH_INDEX_URL or put a CPU wheel in $wheelhouse"
        args+=(--build-arg "TORCH_INDEX_URL=")
        say "torch index $index does not answer: torch from $wheelhouse/$wheel (this machine's pip resolved it), the rest from pip's configured index"
    else
        fail "torch index $index does not answer; set TORCH_INDEX_URL (empty: pip's configured index) or put the wheel in $wheelhouse"
    fi
fi
say "building $image from $dockerfile: ${build[*]} ..."
start=$SECONDS
"${build[@]}" --network host -f "$dockerfile" -t "$image" "${args[@]}" "${secret[@]}" "$@" .
size=$(docker image inspect --format '{{.Size}}' "$image")
say "built $image in $((SECONDS - start)) s: $(awk -v s="$size" 'BEGIN {printf "%.2f GB (%.0f bytes)", s / 1e9, s}')"
