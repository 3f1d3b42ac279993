#!/usr/bin/env bash
# A private Slurm cluster on this machine, to try launch/slurm/train.sbatch and for its tests:
# one slurmctld and MSJAX_SLURM_NODES (default 3) slurmd daemons n1..nN on 127.0.0.1, with their
# own munge key and socket. All state lives under one directory; nothing under /etc is touched.
#
#   launch/slurm/local-cluster.sh up [DIR]      start it; prints the SLURM_CONF=... line to use
#   launch/slurm/local-cluster.sh status [DIR]  the daemons it started, and sinfo
#   launch/slurm/local-cluster.sh down [DIR]    stop exactly the daemons it started
#
# DIR: the argument, else MSJAX_SLURM_DIR, else /tmp/msjax-slurm. Needs Debian's slurm-wlm and
# munge (apt-get install slurm-wlm munge), whose slurmd runs several daemons on one host.
# MSJAX_SLURM_NODES, MSJAX_SLURM_CPUS (CPUs each node declares, default 4) and
# MSJAX_SLURM_CRED_EXPIRE (munge credential lifetime in s, default 10: a requeued job waits
# about that long before it starts again) shape it at `up`.
set -euo pipefail

usage() {
    echo "usage: $0 up|down|status [DIR]  (DIR: default \$MSJAX_SLURM_DIR or /tmp/msjax-slurm)" >&2
    exit 2
}
[ $# -ge 1 ] || usage
action=$1
dir=${2:-${MSJAX_SLURM_DIR:-/tmp/msjax-slurm}}
nodes=${MSJAX_SLURM_NODES:-3}
cpus=${MSJAX_SLURM_CPUS:-4}
cred_expire=${MSJAX_SLURM_CRED_EXPIRE:-10}
conf="$dir/slurm.conf"
pids="$dir/pids"  # one "NAME PID" line per daemon this script started

# A recorded pid counts only while it is still a daemon of this cluster: its command line names
# this cluster's directory (a reused pid of another process is left alone).
ours() {
    local pid=$1
    [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$dir/"
}

running() {
    [ -f "$pids" ] || return 1
    local name pid
    while read -r name pid; do
        ours "$pid" && return 0
    done <"$pids"
    return 1
}

free_ports() {  # N free TCP ports on 127.0.0.1
    "$(command -v python3 || command -v python)" - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

record_pid() {  # NAME PIDFILE: wait for the daemon's pid file, then record its pid
    local name=$1 pidfile=$2 i
    for i in $(seq 100); do
        if [ -s "$pidfile" ]; then
            echo "$name $(cat "$pidfile")" >>"$pids"
            return 0
        fi
        sleep 0.1
    done
    echo "local-cluster: $name did not start; see $dir/log/" >&2
    return 1
}

up() {
    if running; then
        echo "local-cluster: already up in $dir"
        echo "SLURM_CONF=$conf"
        return 0
    fi
    for tool in munged mungekey slurmctld slurmd sinfo; do
        command -v "$tool" >/dev/null || {
            echo "local-cluster: $tool not found; install Slurm and munge (apt-get install slurm-wlm munge)" >&2
            exit 1
        }
    done
    rm -rf "$dir/state" "$dir/spool" "$dir/munge" "$dir/log" "$pids"
    mkdir -p "$dir/state" "$dir/spool" "$dir/munge" "$dir/log"
    chmod 700 "$dir/munge"
    local user
    user=$(id -un)
    read -r -a ports <<<"$(free_ports $((nodes + 1)))"

    mungekey --create --keyfile="$dir/munge/munge.key"
    chmod 400 "$dir/munge/munge.key"
    munged --force --socket="$dir/munge/munge.socket.2" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed"
    record_pid munged "$dir/munge/munged.pid"

    cat >"$conf" <<EOF
# written by launch/slurm/local-cluster.sh: a private cluster on 127.0.0.1
ClusterName=msjax-local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=${ports[0]}
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket.2,cred_expire=$cred_expire
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
# process groups: a job's children end with it; no cgroups, so no CPU binding or memory limit
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.log
SchedulerType=sched/backfill
# schedule often: a requeued job starts as soon as it may (cred_expire + 1 s)
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# nodes may declare more CPUs than the host has
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
MinJobAge=600
InactiveLimit=0
KillWait=30
MailProg=/bin/true
EOF
    local names=""
    for i in $(seq "$nodes"); do
        echo "NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=${ports[$i]} CPUs=$cpus State=UNKNOWN" >>"$conf"
        names="$names${names:+,}n$i"
    done
    echo "PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP" >>"$conf"

    slurmctld -f "$conf"
    record_pid slurmctld "$dir/slurmctld.pid"
    for i in $(seq "$nodes"); do
        slurmd -f "$conf" -N "n$i"
        record_pid "slurmd-n$i" "$dir/slurmd-n$i.pid"
    done
    # up once every node is idle
    local idle=0
    for i in $(seq 150); do
        idle=$(SLURM_CONF=$conf sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
        [ "$idle" -ge "$nodes" ] && break
        sleep 0.2
    done
    if [ "$idle" -lt "$nodes" ]; then
        echo "local-cluster: only $idle of $nodes nodes came up idle; see $dir/log/" >&2
        SLURM_CONF=$conf sinfo -N >&2 || true
        down
        exit 1
    fi
    echo "local-cluster: $nodes nodes (n1-n$nodes, $cpus CPUs each) up in $dir; use:"
    echo "SLURM_CONF=$conf"
}

down() {
    [ -f "$pids" ] || {
        echo "local-cluster: nothing recorded in $dir"
        return 0
    }
    local name pid stopping=()
    # the nodes first, then the controller, munge last (they authenticate through it)
    while read -r name pid; do
        if ours "$pid"; then
            kill -TERM "$pid" && stopping+=("$pid")
        fi
    done < <(tac "$pids")
    for i in $(seq 100); do
        local left=()
        for pid in "${stopping[@]}"; do
            ours "$pid" && left+=("$pid")
        done
        [ ${#left[@]} -eq 0 ] && break
        sleep 0.1
    done
    for pid in "${stopping[@]}"; do
        ours "$pid" && kill -KILL "$pid"
    done
    rm -f "$pids"
    echo "local-cluster: stopped (${#stopping[@]} daemons); state kept in $dir"
}

status() {
    if ! [ -f "$pids" ]; then
        echo "local-cluster: down (nothing recorded in $dir)"
        return 1
    fi
    local name pid alive=0 total=0
    while read -r name pid; do
        total=$((total + 1))
        if ours "$pid"; then
            alive=$((alive + 1))
            echo "$name pid $pid running"
        else
            echo "$name pid $pid not running"
        fi
    done <"$pids"
    echo "SLURM_CONF=$conf"
    SLURM_CONF=$conf sinfo -N || true
    [ "$alive" -eq "$total" ]
}

case "$action" in
up) up ;;
down) down ;;
status) status ;;
*) usage ;;
esac
