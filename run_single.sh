#!/usr/bin/env bash
# This script runs one process, on the CPU or on one GPU.
#
#   ./run_single.sh [ddp_train.py args...]            # This uses the CPU, or the first visible GPU.
#   ./run_single.sh --gpu 3 [ddp_train.py args...]    # This uses GPU 3 only. It sets CUDA_VISIBLE_DEVICES=3.
#   CUDA_VISIBLE_DEVICES=2 ./run_single.sh            # This does the same, but the environment chooses GPU 2.
#   CUDA_VISIBLE_DEVICES= ./run_single.sh             # This forces the CPU on a GPU machine.
#
# PYTHON picks the interpreter. By default it is this directory's .venv, or else python3. SCRIPT picks the
# training script. By default it is ddp_train.py beside this file. It may also be your own script that
# imports ddp_train. The run's files go to --out-dir. By default that is out/SCRIPT in the working
# directory, such as out/ddp_train or out/digits. The same command, run again, continues from its
# checkpoint. make train gives the run out/train/SCRIPT as its --out-dir.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  [[ -x "$here/.venv/bin/python" ]] && PYTHON="$here/.venv/bin/python"
fi
if [[ "${1:-}" == "--gpu" ]]; then
  [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || { echo "run_single.sh: --gpu needs a GPU index, such as --gpu 0" >&2; exit 2; }
  export CUDA_VISIBLE_DEVICES=$2
  shift 2
fi
# A script of your own imports ddp_train. It gets the one beside this file, unless its own directory
# has one.
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" "${SCRIPT:-$here/ddp_train.py}" "$@"
