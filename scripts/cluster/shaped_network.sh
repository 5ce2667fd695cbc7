#!/usr/bin/env bash
# A real shaped network on this machine: one network namespace per worker, each joined by a
# veth pair to a bridge, each worker's uplink limited by tc HTB (docs/cost.md).
#
#   scripts/cluster/shaped_network.sh up [RATE]       # create it (RATE: tc syntax, e.g. 10mbit)
#   scripts/cluster/shaped_network.sh rate RATE       # change every worker's uplink rate in place
#   scripts/cluster/shaped_network.sh status          # namespaces, addresses, HTB classes and counters
#   scripts/cluster/shaped_network.sh exec I CMD ...  # run CMD in worker I's namespace
#   scripts/cluster/shaped_network.sh addr I          # worker I's address
#   scripts/cluster/shaped_network.sh down            # remove everything it created
#
# Needs root, ip(8) and tc(8) (iproute2) and the htb qdisc. Settings (environment):
#   SHAPED_WORKERS  number of workers, one namespace each            (default 2)
#   SHAPED_RATE     each worker's uplink rate, tc units (bit/s)      (default 10mbit)
#   SHAPED_DOWN     each worker's downlink rate, tc units; empty: not limited (default empty)
#   SHAPED_NET      the /24 the namespaces get addresses in          (default 10.207.33)
#   SHAPED_NAME     prefix of every name it creates                  (default gfl)
# It only adds addresses inside the namespaces it creates (worker I: $SHAPED_NET.(I+1)); the
# bridge has no address and nothing outside the namespaces is routed. `up` removes what it
# made if any step fails.
set -Eeuo pipefail   # -E: the ERR trap of `up` also fires inside the functions it calls

WORKERS="${SHAPED_WORKERS:-2}"
RATE="${SHAPED_RATE:-10mbit}"
DOWN="${SHAPED_DOWN:-}"
NET="${SHAPED_NET:-10.207.33}"
NAME="${SHAPED_NAME:-gfl}"
BRIDGE="${NAME}br0"

ns() { echo "${NAME}-w$1"; }             # worker I's namespace
host_if() { echo "${NAME}h$1"; }          # its veth end on the bridge (the worker's downlink)
ns_if() { echo "${NAME}n$1"; }            # its veth end in the namespace (the worker's uplink)
addr() { echo "${NET}.$(( $1 + 1 ))"; }

need_root() {
  if [[ $(id -u) -ne 0 ]]; then echo "shaped_network.sh: needs root (ip netns, tc)" >&2; exit 1; fi
  for tool in ip tc; do
    command -v "$tool" >/dev/null || { echo "shaped_network.sh: $tool (iproute2) not found" >&2; exit 1; }
  done
}

# HTB on an interface's egress: one class, every packet in it, RATE = ceil.
shape() {  # shape NETNS|"" IFACE RATE
  local where=() ; [[ -n "$1" ]] && where=(ip netns exec "$1")
  "${where[@]}" tc qdisc add dev "$2" root handle 1: htb default 10
  "${where[@]}" tc class add dev "$2" parent 1: classid 1:10 htb rate "$3" ceil "$3"
}

reshape() {  # reshape NETNS IFACE RATE: a new rate for the class made by shape
  ip netns exec "$1" tc class change dev "$2" parent 1: classid 1:10 htb rate "$3" ceil "$3"
}

reach() {  # reach I: a TCP connection from worker I's namespace to worker 0's
  local py="${PYTHON:-python3}"
  ip netns exec "$(ns 0)" "$py" -c '
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
s.settimeout(10); c, _ = s.accept(); c.close()' "$(addr 0)" > "/tmp/${NAME}-reach.$$" &
  local pid=$! port=""
  for _ in $(seq 50); do port=$(head -n 1 "/tmp/${NAME}-reach.$$" 2>/dev/null || true); [[ -n "$port" ]] && break; sleep 0.1; done
  rm -f "/tmp/${NAME}-reach.$$"
  ip netns exec "$(ns "$1")" "$py" -c '
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10).close()' "$(addr 0)" "$port"
  wait "$pid"
}

down() {
  local i
  for ((i = 0; i < WORKERS; i++)); do
    ip netns del "$(ns "$i")" 2>/dev/null || true        # takes its veth pair with it
    ip link del "$(host_if "$i")" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
}

up() {
  local i
  if ip link show "$BRIDGE" >/dev/null 2>&1; then
    echo "shaped_network.sh: $BRIDGE exists already (run down first)" >&2; exit 1
  fi
  trap 'echo "shaped_network.sh: up failed; removing what it made" >&2; down' ERR
  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" up
  for ((i = 0; i < WORKERS; i++)); do
    ip netns add "$(ns "$i")"
    ip link add "$(host_if "$i")" type veth peer name "$(ns_if "$i")"
    ip link set "$(ns_if "$i")" netns "$(ns "$i")"
    ip link set "$(host_if "$i")" master "$BRIDGE"
    ip link set "$(host_if "$i")" up
    ip netns exec "$(ns "$i")" ip link set lo up
    ip netns exec "$(ns "$i")" ip addr add "$(addr "$i")/24" dev "$(ns_if "$i")"
    ip netns exec "$(ns "$i")" ip link set "$(ns_if "$i")" up
    shape "$(ns "$i")" "$(ns_if "$i")" "$RATE"
    if [[ -n "$DOWN" ]]; then shape "" "$(host_if "$i")" "$DOWN"; fi
  done
  for ((i = 1; i < WORKERS; i++)); do     # every namespace reaches worker 0 over TCP
    reach "$i"
  done
  trap - ERR
  echo "up: $WORKERS workers ($(for ((i = 0; i < WORKERS; i++)); do printf '%s=%s ' "$(ns "$i")" "$(addr "$i")"; done)), uplink $RATE${DOWN:+, downlink $DOWN}"
}

rate() {
  local i
  for ((i = 0; i < WORKERS; i++)); do reshape "$(ns "$i")" "$(ns_if "$i")" "$1"; done
  echo "uplink rate of $WORKERS workers: $1"
}

status() {
  local i
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then echo "down"; return 0; fi
  for ((i = 0; i < WORKERS; i++)); do
    echo "== $(ns "$i") $(addr "$i")"
    ip netns exec "$(ns "$i")" tc -s class show dev "$(ns_if "$i")" | sed 's/^/   /'
  done
}

cmd="${1:-}"
shift || true
case "$cmd" in
  up) need_root; [[ -n "${1:-}" ]] && RATE="$1"; up ;;
  down) need_root; down; echo "down" ;;
  rate) need_root; rate "${1:?rate RATE}" ;;
  status) need_root; status ;;
  exec) need_root; i="${1:?exec I CMD ...}"; shift; exec ip netns exec "$(ns "$i")" "$@" ;;
  addr) addr "${1:?addr I}" ;;
  *) sed -n '2,9p' "$0" >&2; exit 2 ;;
esac
