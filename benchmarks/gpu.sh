#!/usr/bin/env bash
# The GPU tests and the GPU benchmarks, on a machine with a CUDA GPU whose Python already has a CUDA build
# of torch and no internet (docs/BENCHMARKS.md, "On a GPU"). Two steps:
#
#   bash benchmarks/gpu.sh wheels DIR    here, with a package index: the wheels such a machine lacks
#   bash benchmarks/gpu.sh run DIR OUT   there, in the repository: those wheels and diloco into its Python,
#                                        then `pytest -m gpu` and the benchmarks, their output into OUT
#   bash benchmarks/gpu.sh codecs DIR OUT   the same install, `pytest -m gpu` and the codec benchmark alone
#                                        (what a change to the codecs needs: 100 s against run's 340-437 s on an H200)
#
# Either ends by packing OUT's files into OUT/results.tar.gz too (for a lent machine that hands back few files).
#
# TARGET_PY (default 3.12) is the GPU machine's Python version. The wheels are those hivemind and diloco need
# beyond what a CUDA machine with torch, numpy, scipy, rich, typer, msgpack and pytest already holds.
set -euo pipefail

WHEELS=(hivemind==1.1.12 zstandard configargparse base58 blake3 cffi pycparser cryptography grpcio grpcio-tools
        protobuf mmh3 morphys netaddr prefetch_generator py-cid py-multibase py-multicodec py-multihash pydantic
        pydantic_core annotated-types typing-inspection typing_extensions idna python-baseconv varint pytest-timeout
        six setuptools wheel pip)
here="$(cd "$(dirname "$0")/.." && pwd)"

wheels() {
    local dir="$1" py="${TARGET_PY:-3.12}" pip="${PIP:-$here/.venv/bin/pip}"
    mkdir -p "$dir"
    for req in "${WHEELS[@]}"; do
        # a binary wheel for the target's Python; a project published as source only is built here (pure Python)
        "$pip" download -q --no-deps --dest "$dir" --only-binary=:all: --python-version "$py" --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -c "$here/constraints.txt" "$req" 2>/dev/null \
        || "$pip" wheel -q --no-deps --wheel-dir "$dir" -c "$here/constraints.txt" "$req"
    done
    # a wheel built here is for any Python only if it is pure: anything else would not install there
    local tag="cp${py/./}"
    if ls "$dir" | grep -v -E -- "-(py3|py2\.py3)-none-any\.whl$|-${tag}-|-abi3-|-py3-none-manylinux"; then
        echo "error: the wheels above are not for Python $py" >&2
        return 1
    fi
    du -sh "$dir"
}

install() {
    local dir="$1" out="$2"
    mkdir -p "$out"
    python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU"; print("torch", torch.__version__)'
    # Into the machine's own Python (its torch may live in a venv, which a venv of ours would not see): the
    # machine is a throwaway one, lent for the run. A venv made without pip gets the carried one.
    python3 -m pip --version > /dev/null 2>&1 || python3 -m ensurepip > /dev/null 2>&1 \
        || python3 "$(ls "$dir"/pip-*.whl)/pip" install -q --no-index "$dir"/pip-*.whl
    python3 -m pip install -q --no-index --find-links "$dir" "${WHEELS[0]}" zstandard pytest-timeout "setuptools>=77" wheel
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e "$here"
    { nvidia-smi; uname -m; python3 -m pip list; python3 -m pip check; } > "$out/machine.txt" 2>&1 || true
}

gpu_tier() {
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py > "$1/test-gpu.txt" 2>&1
    local rc=$?
    tail -5 "$1/test-gpu.txt"
    return "$rc"
}

codecs() {
    python3 -m diloco bench codecs --device cuda --quiet --size 16777216 --input demo \
        --json "$1/codecs.json" --profile "$1/profile-codecs.txt" > "$1/codecs.md"
    local rc=$?
    cat "$1/codecs.md"
    return "$rc"
}

run() {
    local dir="$1" out="$2"
    install "$dir" "$out"
    cd "$here"
    local rc=0  # every step runs whatever the one before did: a lent GPU is rare
    gpu_tier "$out" || rc=$?
    codecs "$out" || rc=$?
    python3 -m diloco bench wrapper --device cuda --quiet -H 50 -H 500 --repeats 2 --json "$out/wrapper.json" || rc=$?
    # 85M parameters in bf16 autocast, 16 × 256 bytes a step: θ in host memory (the default; H=50 and 500), then
    # on the GPU (H=50); each with a profile of its timed synchronizations
    local big=(--device cuda --d-model 768 --layers 12 --batch-size 16 --context 256 --autocast --quiet)
    python3 -m diloco bench wrapper "${big[@]}" --repeats 3 --global-device cpu -H 50 -H 500 --steps 500 \
        --profile "$out/profile-85m-cpu.txt" --json "$out/wrapper-85m-cpu.json" || rc=$?
    python3 -m diloco bench wrapper "${big[@]}" --repeats 2 --global-device cuda -H 50 --steps 300 \
        --profile "$out/profile-85m-cuda.txt" --json "$out/wrapper-85m-cuda.json" || rc=$?
    python3 -m diloco bench transfer --device cuda --json "$out/transfer-gpt.json" || rc=$?
    python3 -m diloco bench transfer --device cuda --d-model 1024 --layers 24 --json "$out/transfer-gpt-300m.json" \
        || rc=$?
    return "$rc"
}

codecs_only() {
    local dir="$1" out="$2"
    install "$dir" "$out"
    cd "$here"
    local rc=0
    gpu_tier "$out" || rc=$?
    codecs "$out" || rc=$?
    return "$rc"
}

pack() {  # on the way out, whatever ended the run (the script's exit status stays the run's)
    local packed
    packed="$(mktemp)" && [ -d "$1" ] && tar czf "$packed" --exclude results.tar.gz -C "$1" . \
        && mv "$packed" "$1/results.tar.gz" && ls -l "$1/results.tar.gz" || true
}

case "${1:-}" in
    wheels) wheels "${2:?wheels DIR}" ;;
    run) trap "pack '$(realpath -m "${3:?run DIR OUT}")'" EXIT; run "${2:?run DIR OUT}" "$3" ;;
    codecs) trap "pack '$(realpath -m "${3:?codecs DIR OUT}")'" EXIT; codecs_only "${2:?codecs DIR OUT}" "$3" ;;
    *) sed -n '2,12p' "$0"; exit 2 ;;
esac
