#!/usr/bin/env bash
# Run a command with CUDA MPS (the multi-process service) on. The runs of a sweep that share one
# GPU then run their kernels side by side; without it they take turns (time-slicing), and small
# CNN steps leave most of the GPU idle. Starts the MPS control daemon unless one answers already,
# and stops it afterwards if it started it. With MPS=0, or no nvidia-cuda-mps-control on the
# PATH, the command runs as it is. The command's exit status is this script's.
#
#   infra/with_mps.sh make cnn-gap-gpu-runs
set -u
if [ "${MPS:-1}" = 0 ] || ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  echo "with_mps: without MPS (MPS=${MPS:-1}; nvidia-cuda-mps-control $(command -v nvidia-cuda-mps-control >/dev/null 2>&1 && echo found || echo 'not found'))" >&2
  exec "$@"
fi
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-${TMPDIR:-/tmp}/gluon-mps-$(id -u)}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-$CUDA_MPS_PIPE_DIRECTORY/log}
mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
started=0
if echo get_server_list | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1; then
  echo "with_mps: an MPS daemon is running already ($CUDA_MPS_PIPE_DIRECTORY)" >&2
elif nvidia-cuda-mps-control -d; then
  started=1
  echo "with_mps: MPS daemon started ($CUDA_MPS_PIPE_DIRECTORY)" >&2
else
  echo "with_mps: the MPS daemon did not start; without MPS" >&2
  exec "$@"
fi
stop() { if [ $started = 1 ]; then echo quit | timeout 30 nvidia-cuda-mps-control; echo "with_mps: MPS daemon stopped" >&2; fi; }
trap stop EXIT
trap 'exit 130' INT TERM
"$@"
