#!/usr/bin/env bash
# The wheels sinklab needs on a stock GPU image beyond what the image has (issue 39): such an image has Python 3.12,
# torch, Lightning, transformers, numpy, pandas, pyarrow, huggingface-hub and the like, but no package registry and no
# hydra-core, omegaconf or antlr4-python3-runtime (hydra-core's parser). This makes them here, for the image's Python
# (cp312, manylinux x86_64), into DEST, an ignored folder that travels with the working tree:
#
#   bash scripts/gpu_wheels.sh [--prepare] DEST        # e.g. .whl (in .gitignore)
#
# --prepare adds datasets, dill and multiprocess, for `sinklab prepare` on the image (training from a prepared
# directory, `sinklab measure` and the GPU check need none of them; nor do they need wandb or
# hydra-submitit-launcher, which only logger=wandb and hydra/launcher=slurm|local use). On the image:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site DEST/*.whl
#   export PYTHONPATH=/tmp/site
#
# One pinned version of each (the versions the GPU check ran with), all pure-Python wheels: pip download for those
# PyPI has as wheels, pip wheel for antlr4-python3-runtime (an sdist only). DEST's old wheels are replaced. Prints the
# total size; refuses, in one line, a set over 64 MiB (what a device call carries with the working tree).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=(hydra-core==1.3.2 omegaconf==2.3.1)
SDIST=(antlr4-python3-runtime==4.9.3)  # hydra-core 1.3 asks for antlr4 4.9.*
PREPARE=(datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
LIMIT_MIB=64
PY=${PYTHON:-python3}

usage="usage: gpu_wheels.sh [--prepare] DEST"
want=("${BASE[@]}") dest=
for arg in "$@"; do
  case $arg in
    --prepare) want+=("${PREPARE[@]}") ;;
    -*) echo "error: unknown option $arg; $usage" >&2; exit 2 ;;
    *) [ -z "$dest" ] || { echo "error: more than one DEST ($dest, $arg); $usage" >&2; exit 2; }; dest=$arg ;;
  esac
done
[ -n "$dest" ] || { echo "error: $usage" >&2; exit 2; }
if git rev-parse --is-inside-work-tree >/dev/null 2>&1 && [[ "$(realpath -m "$dest")" == "$PWD"/* ]] \
    && ! git check-ignore -q "$dest/x.whl"; then
  echo "error: DEST=$dest is not ignored by git; use an ignored folder such as .whl" >&2
  exit 2
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# --python-version 3.12 --implementation cp: the image's interpreter (multiprocess ships one wheel per Python)
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$tmp" "${want[@]}"
$PY -m pip wheel -q --no-deps -w "$tmp" "${SDIST[@]}"

# exactly one wheel per pinned requirement, at its version (a wheel's name: the project, '-' as '_', then the version)
for req in "${want[@]}" "${SDIST[@]}"; do
  name=${req%%==*} version=${req##*==}
  found=("$tmp/${name//-/_}-$version-"*.whl)
  [ ${#found[@]} -eq 1 ] && [ -f "${found[0]}" ] || { echo "error: no single wheel of $req in $tmp" >&2; exit 1; }
done
count=$(ls "$tmp"/*.whl | wc -l)
expected=$(( ${#want[@]} + ${#SDIST[@]} ))
[ "$count" -eq "$expected" ] || { echo "error: $count wheels for $expected requirements" >&2; exit 1; }
bytes=$(cat "$tmp"/*.whl | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.2f", b / 1048576 }')
if [ "$bytes" -gt $(( LIMIT_MIB * 1048576 )) ]; then
  echo "error: the wheels come to $mib MiB, over the $LIMIT_MIB MiB a device call carries (DEST left as it was)" >&2
  exit 2
fi
mkdir -p "$dest"
rm -f "$dest"/*.whl
mv "$tmp"/*.whl "$dest"/
ls -1 "$dest"/*.whl
echo "$count wheels, $mib MiB in $dest"
