#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (slurmctld + slurmd on the local host), for the
# `make test-slurm` target and for rehearsing a cluster sweep before using a real one.
#
#   scripts/cluster/slurm_cluster.sh up        # install slurm-wlm + munge if missing, start munged,
#                                      # slurmctld and slurmd, wait until the node is idle
#   scripts/cluster/slurm_cluster.sh status    # exit 0 when the cluster answers and its node is usable
#   scripts/cluster/slurm_cluster.sh down      # cancel every job, stop the daemons this script started
#   scripts/cluster/slurm_cluster.sh conf      # print the path of its slurm.conf
#   scripts/cluster/slurm_cluster.sh run -- CMD [ARGS...]
#                                      # up (unless already up), CMD with SLURM_CONF set, then
#                                      # down (only if this call brought it up); CMD's exit status
#
# `up` and `down` are idempotent: `up` on a running cluster, `down` on a stopped one do nothing.
# Needs root: the daemons run as root (SlurmUser=root) and packages come from apt-get (Debian's
# slurm-wlm 22.05). Without root it fails and says why.
#
# The cluster: NodeName = `hostname -s` with the CPUs and memory `slurmd -C` reports, one
# partition `local` (the default), proctrack/linuxproc, task/none (no cgroups), no accounting
# database (accounting_storage/none: `sacct` does not work, `squeue` and `scontrol` do), and
# short KillWait (SIGTERM -> SIGKILL) and cred_expire (how long a requeued job waits before it
# may start again) so that tests of preemption and requeue take seconds, not minutes.
# Its slurm.conf, state, spool and logs are in .slurm/ (git-ignored; GLUON_SLURM_CLUSTER_DIR
# to put them elsewhere). The job state survives `down` + `up` (job ids keep increasing).
# Clients find the config through SLURM_CONF (`export SLURM_CONF=$(scripts/cluster/slurm_cluster.sh
# conf)`); when /etc/slurm/slurm.conf does not exist, `up` also links it there (and `down`
# removes the link), so that plain `sbatch` / `squeue` work too.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${GLUON_SLURM_CLUSTER_DIR:-$ROOT/.slurm}"
CONF="$DIR/slurm.conf"
RUN="$DIR/run"
LOG="$DIR/log"
ETC_CONF=/etc/slurm/slurm.conf
PARTITION=local
KILL_WAIT=5          # seconds between SIGTERM and SIGKILL (default 30)
CRED_EXPIRE=5        # seconds a requeued job waits before it may start again (default 120)
UP_TIMEOUT=90        # seconds `up` waits for the node to become idle

say() { echo "slurm_cluster: $*"; }
die() { echo "slurm_cluster: ERROR: $*" >&2; exit 1; }

alive() {  # alive PIDFILE: the process whose pid is in PIDFILE is running
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

node_name() { hostname -s; }

need_root() {
    [[ $EUID -eq 0 ]] && return 0
    die "'$1' needs root (running as $(id -un)): slurmctld and slurmd run as root here and the
packages are installed with apt-get. Run it as root, e.g. in the CI container, or with sudo."
}

ensure_packages() {
    local missing=()
    for cmd in slurmctld slurmd sbatch munged; do
        command -v "$cmd" >/dev/null || missing+=("$cmd")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    command -v apt-get >/dev/null ||
        die "SLURM is not installed (${missing[*]} missing) and there is no apt-get to install it"
    say "installing slurm-wlm and munge (${missing[*]} missing)"
    export DEBIAN_FRONTEND=noninteractive
    local pkgs=(slurm-wlm munge)
    apt-get install -y -q --no-install-recommends "${pkgs[@]}" >"$LOG/apt-get.log" 2>&1 || {
        apt-get update -q >>"$LOG/apt-get.log" 2>&1 &&
        apt-get install -y -q --no-install-recommends "${pkgs[@]}" >>"$LOG/apt-get.log" 2>&1
    } || { tail -n 20 "$LOG/apt-get.log" >&2; die "apt-get install ${pkgs[*]} failed (log: $LOG/apt-get.log)"; }
    for cmd in slurmctld slurmd sbatch munged; do
        command -v "$cmd" >/dev/null || die "$cmd still missing after apt-get install ${pkgs[*]}"
    done
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

ensure_munge() {
    local key=/etc/munge/munge.key
    if [[ ! -s $key ]]; then
        say "creating $key"
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile="$key" --force
        else
            dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
        fi
        chown munge:munge "$key" 2>/dev/null || true
        chmod 0400 "$key"
    fi
    munge_works && return 0
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
    if id munge >/dev/null 2>&1; then
        runuser -u munge -- munged
    else
        munged --force
    fi
    for _ in $(seq 50); do munge_works && break; sleep 0.1; done
    munge_works || die "munged does not answer (munge -n | unmunge fails); see /var/log/munge/munged.log"
    # remember it: `down` stops munged only when `up` started it
    cp /run/munge/munged.pid "$RUN/munged.pid" 2>/dev/null || pgrep -nx munged >"$RUN/munged.pid"
}

write_conf() {
    local node hw
    node="$(node_name)"
    # e.g. "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105"
    hw="$(slurmd -C | head -n 1 | sed -E 's/^NodeName=[^ ]+ //')"
    [[ $hw == *CPUs=* && $hw == *RealMemory=* ]] || die "unexpected 'slurmd -C' output: $hw"
    mkdir -p "$DIR/state" "$DIR/spool" "$RUN" "$LOG"
    cat >"$CONF" <<EOF
# Written by scripts/cluster/slurm_cluster.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ); rewritten by each 'up'.
ClusterName=gluon-local
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=$CRED_EXPIRE
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
JobRequeue=1
ReturnToService=2
KillWait=$KILL_WAIT
InactiveLimit=0
MinJobAge=300
MessageTimeout=30
SlurmctldTimeout=60
SlurmdTimeout=300
MailProg=/bin/true
NodeName=$node NodeAddr=127.0.0.1 $hw State=UNKNOWN
PartitionName=$PARTITION Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
    if [[ ! -e $ETC_CONF && ! -L $ETC_CONF ]]; then
        mkdir -p "$(dirname "$ETC_CONF")"
        ln -s "$CONF" "$ETC_CONF"
    fi
}

node_state() { SLURM_CONF="$CONF" sinfo -h -n "$(node_name)" -o %T 2>/dev/null | head -n 1; }

status() {
    [[ -f $CONF ]] && alive "$RUN/slurmctld.pid" && alive "$RUN/slurmd.pid" || return 1
    SLURM_CONF="$CONF" scontrol ping 2>/dev/null | grep -q UP || return 1
    case "$(node_state)" in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac
}

stop_pid() {  # stop_pid NAME PIDFILE: SIGTERM, wait up to 15 s, then SIGKILL
    local pid
    alive "$2" || { rm -f "$2"; return 0; }
    pid="$(cat "$2")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
    rm -f "$2"
    say "stopped $1 ($pid)"
}

show_logs() {
    for f in "$LOG/slurmctld.log" "$LOG/slurmd.log"; do
        [[ -f $f ]] && { echo "--- last lines of $f" >&2; tail -n 15 "$f" >&2; }
    done
}

up() {
    local t0=$SECONDS start state node
    start=$(date +%s.%N)
    need_root up
    mkdir -p "$RUN" "$LOG"
    ensure_packages
    ensure_munge
    if status; then say "already up (node $(node_name) $(node_state)); SLURM_CONF=$CONF"; return 0; fi
    stop_pid slurmd "$RUN/slurmd.pid"          # leftovers of a half-started cluster
    stop_pid slurmctld "$RUN/slurmctld.pid"
    write_conf
    node="$(node_name)"
    export SLURM_CONF="$CONF"
    slurmctld -f "$CONF" || { show_logs; die "slurmctld did not start"; }
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
    scontrol ping 2>/dev/null | grep -q UP || { show_logs; die "slurmctld does not answer (scontrol ping)"; }
    slurmd -f "$CONF" || { show_logs; die "slurmd did not start"; }
    while (( SECONDS - t0 < UP_TIMEOUT )); do
        state="$(node_state)"
        case "$state" in
            idle|mixed|allocated|completing) break ;;
            down*|drain*|drained*|fail*)
                scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.5
    done
    status || { show_logs; die "node $node is '${state:-unknown}' after ${UP_TIMEOUT} s, not idle"; }
    say "up in $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b - a}') s: $(slurmctld -V), node $node ($(sinfo -h -n "$node" -o '%c CPUs, %m MB'), $(node_state)), partition $PARTITION; export SLURM_CONF=$CONF"
}

down() {
    local jobs
    if [[ $EUID -ne 0 ]] && ! alive "$RUN/slurmctld.pid" && ! alive "$RUN/slurmd.pid" \
            && ! alive "$RUN/munged.pid"; then
        say "not running"; return 0
    fi
    need_root down
    export SLURM_CONF="$CONF"
    if alive "$RUN/slurmctld.pid"; then
        jobs="$(squeue -h -o %i 2>/dev/null || true)"
        if [[ -n $jobs ]]; then
            say "cancelling $(wc -w <<<"$jobs") job(s)"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for _ in $(seq $((10 * (KILL_WAIT + 15)))); do   # until they are gone
                [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break
                sleep 0.1
            done
        fi
    fi
    stop_pid slurmd "$RUN/slurmd.pid"
    stop_pid slurmctld "$RUN/slurmctld.pid"
    stop_pid munged "$RUN/munged.pid"          # only when `up` started it
    if [[ -L $ETC_CONF && "$(readlink "$ETC_CONF")" == "$CONF" ]]; then rm -f "$ETC_CONF"; fi
    say "down"
}

run() {
    local started=0 rc=0
    [[ ${1:-} == -- ]] && shift
    [[ $# -gt 0 ]] || die "usage: $0 run -- CMD [ARGS...]"
    if ! status 2>/dev/null; then
        "$0" up || die "the SLURM cluster did not come up, so '$*' was NOT run"
        started=1
    fi
    export SLURM_CONF="$CONF"
    if [[ $started -eq 1 ]]; then trap 'down' EXIT; trap 'exit 130' INT TERM; fi
    "$@" || rc=$?
    return "$rc"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status)
        if status; then say "up: node $(node_name) $(node_state); SLURM_CONF=$CONF"
        else say "not running (or node not usable)"; exit 1; fi ;;
    conf) echo "$CONF" ;;
    run) shift; run "$@" ;;
    *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
