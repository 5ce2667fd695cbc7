#!/usr/bin/env bash
# Run a command with CUDA MPS (the multi-process service) on. The runs of a sweep that share one
# GPU then run their kernels side by side; without it they take turns (time-slicing), and small
# CNN steps leave most of the GPU idle. Uses an MPS daemon that answers already (the system's, at
# CUDA's default pipe folder, or the one CUDA_MPS_PIPE_DIRECTORY names); else starts one with its
# own pipe folder and stops it afterwards. With MPS=0, or no nvidia-cuda-mps-control on the PATH,
# the command runs as it is. The command's exit status is this script's; INT and TERM are passed on.
#
#   scripts/cluster/with_mps.sh make cnn-gap-gpu-runs
set -u
control=nvidia-cuda-mps-control
if [ "${MPS:-1}" = 0 ] || ! command -v $control >/dev/null 2>&1; then
  echo "with_mps: without MPS (MPS=${MPS:-1}; $control $(command -v $control >/dev/null 2>&1 && echo found || echo 'not found'))" >&2
  exec "$@"
fi
answers() { echo get_server_list | timeout 10 $control >/dev/null 2>&1; }
started=0
if answers; then
  echo "with_mps: using the MPS daemon at ${CUDA_MPS_PIPE_DIRECTORY:-the default pipe folder}" >&2
else
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-${TMPDIR:-/tmp}/gluon-mps-$(id -u)}
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-$CUDA_MPS_PIPE_DIRECTORY/log}
  mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
  if answers; then
    echo "with_mps: using the MPS daemon at $CUDA_MPS_PIPE_DIRECTORY" >&2
  elif $control -d; then
    started=1
    echo "with_mps: MPS daemon started at $CUDA_MPS_PIPE_DIRECTORY" >&2
  else
    echo "with_mps: the MPS daemon did not start; without MPS" >&2
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    exec "$@"
  fi
fi
stop() {
  [ $started = 1 ] || return 0
  if echo quit | timeout 30 $control; then echo "with_mps: MPS daemon stopped" >&2
  else echo "with_mps: the MPS daemon did not stop (echo quit | $control)" >&2; fi
}
trap stop EXIT
"$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' INT TERM
status=0
wait "$child" || status=$?
while kill -0 "$child" 2>/dev/null; do wait "$child"; status=$?; done   # woken by a signal
exit "$status"
