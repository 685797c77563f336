#!/usr/bin/env bash
# One process: on the CPU, or on one GPU.
#
#   ./run_single.sh [ddp_train.py args...]            # CPU, or the first visible GPU
#   ./run_single.sh --gpu 3 [ddp_train.py args...]    # GPU 3 only (sets CUDA_VISIBLE_DEVICES=3)
#   CUDA_VISIBLE_DEVICES=2 ./run_single.sh            # the same, chosen by the environment
#   CUDA_VISIBLE_DEVICES= ./run_single.sh             # force the CPU on a GPU machine
#
# PYTHON picks the interpreter (default: this directory's .venv, else python3). SCRIPT picks the training
# script (default: ddp_train.py beside this file; or your own that imports ddp_train). The run's files go to
# --out-dir, by default out/SCRIPT in the working directory (out/ddp_train, out/digits): the same command
# again continues from its checkpoint. (make train gives it out/train/SCRIPT.)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  [[ -x "$here/.venv/bin/python" ]] && PYTHON="$here/.venv/bin/python"
fi
if [[ "${1:-}" == "--gpu" ]]; then
  [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || { echo "run_single.sh: --gpu needs a GPU index, e.g. --gpu 0" >&2; exit 2; }
  export CUDA_VISIBLE_DEVICES=$2
  shift 2
fi
# A script of your own imports ddp_train: the one beside this file, unless its own directory has one.
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" "${SCRIPT:-$here/ddp_train.py}" "$@"
