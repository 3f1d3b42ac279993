#!/usr/bin/env bash
# Fetch the wheels that the GPU test machine's image lacks, so benchmarks/gpu_suite.py runs there
# without a network: grain and what grain needs beyond jax's own stack, and jax-triton.
#
#   benchmarks/gpu_kit.sh            # download into .whl/ (ignored by git)
#   benchmarks/gpu_kit.sh --check    # also prove the set is complete: a clean Python 3.12 venv
#                                    # with only jax's own dependencies imports grain and
#                                    # runs a dataset from the installed wheels
#
# gpu_suite.py installs each wheel in .whl/ whose package the image lacks with `pip install
# --no-index --no-deps --target` into a scratch folder, on PYTHONPATH before its first part. The image runs
# Python 3.12 on x86_64 (jax 0.11.2 with CUDA 13, triton 3.6): jax-triton 0.4 needs triton 3.7,
# so 0.3.1 is the newest that fits.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${MSJAX_GPU_WHEELS:-$REPO/.whl}"
PYTHON312="${PYTHON312:-/root/.pyenv/versions/3.12.1/bin/python}"
# Not in that image; everything else grain needs (absl-py, etils, numpy, protobuf) comes with
# jax, flax and orbax, which it has.
PACKAGES=(
  "grain==0.2.18"
  "array-record>=0.8.1"
  "cloudpickle"
  "portpicker"
  "psutil"
  "jax-triton==0.3.1"
  "pytest" "pluggy" "iniconfig" "packaging" "pygments"  # the suite's `pytest -m gpu`
)

mkdir -p "$WHEELS"
python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  --dest "$WHEELS" "${PACKAGES[@]}"
echo "wheels in $WHEELS:"
ls -1 "$WHEELS"

if [[ "${1:-}" == "--check" ]]; then
  scratch="$(mktemp -d)"
  trap 'rm -rf "$scratch"' EXIT
  "$PYTHON312" -m venv "$scratch/venv"
  # what the image brings for grain: jax's and orbax's own dependencies, not grain's extras
  "$scratch/venv/bin/python" -m pip install --quiet numpy absl-py "etils[epath,epy]" protobuf
  "$scratch/venv/bin/python" -m pip install --quiet --no-index --no-deps \
    --target "$scratch/site" "$WHEELS"/*.whl
  # jax_triton is left out here: it imports jax and triton, which the image has
  if ! PYTHONPATH="$scratch/site" "$scratch/venv/bin/python" -W ignore -c '
import array_record, grain, grain.python as gp, portpicker, pytest
rows = [list(batch) for batch in gp.MapDataset.range(6).map(lambda x: x * 2).batch(3)]
assert rows == [[0, 2, 4], [6, 8, 10]], rows
'; then
    echo "incomplete: grain does not import from the wheels in $WHEELS"
    exit 1
  fi
  echo "complete: a clean Python 3.12 venv imports grain (and runs a dataset) and pytest from these wheels"
fi
