#!/usr/bin/env bash
# tests/cuda on a lent GPU machine that reaches no package index, with the image's own torch,
# Triton and transformers (Python 3.12).
#
#   here:   tests/cuda/device.sh prepare
#           wheels of Kiln's packages and of what the image lacks, and the default model's
#           tokenizer files, into .gpu/ (git ignores it; name it in the run's carry)
#   there:  bash tests/cuda/device.sh run [pytest arguments]
#           installs the wheels into /tmp/site and runs tests/cuda (or the tests the arguments name),
#           writing the log to $OUT/pytest.log where $OUT is set
set -euo pipefail
cd "$(dirname "$0")/../.."

case "${1:-}" in
prepare)
    PY=.venv/bin/python
    rm -rf .gpu && mkdir -p .gpu/whl .gpu/tok
    # Not in the GPU image (its package list: /work/.library/device/KINDS.md); same versions as here.
    missing=$($PY -c 'import importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in
        ("pydantic", "pydantic_core", "annotated-types", "typing-inspection")))')
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl $missing
    $PY -m pip wheel -q --no-deps --no-build-isolation -w .gpu/whl ./core ./plugins/cpu ./plugins/cuda ./plugins/tool_parsers
    folder=$($PY -c 'from kiln.models.loader import resolve_model; print(resolve_model(None, "auto").path)')
    find "$folder" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} .gpu/tok/ \;  # all but the weights
    du -sh .gpu
    ;;
run)
    shift
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kiln-cache KILN_TEST_TOKENIZER_DIR=$PWD/.gpu/tok
    nvidia-smi -L
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
        "transformers", transformers.__version__, torch.cuda.get_device_name())'
    # Options alone (-x, -k EXPR...) still run tests/cuda; an argument that names a test file or
    # folder (or a test in one: path::name) replaces it.
    paths=tests/cuda
    for arg in "$@"; do [[ -e ${arg%%::*} ]] && paths=; done
    python3 -m pytest -q -rs -p no:cacheprovider --durations=10 "$@" $paths 2>&1 | tee "${OUT:-/tmp}/pytest.log"
    ;;
*)
    echo "usage: $0 prepare | run [pytest arguments]" >&2
    exit 2
    ;;
esac
