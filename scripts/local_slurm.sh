#!/usr/bin/env bash
# Usage: bash scripts/local_slurm.sh start DIR [GPUS_PER_NODE]   (root; installs slurm-wlm and munge if missing)
#        bash scripts/local_slurm.sh stop DIR
#        bash scripts/local_slurm.sh status DIR
#
# A real Slurm (Debian's slurm-wlm) on this one machine, for tests of examples/slurm/: one slurmctld
# and two slurmd acting as two nodes (named after this host's short name and "localhost", both
# resolving here, each slurmd with its own port and spool), each node offering GPUS_PER_NODE
# (default 4) "GPUs": gres files that are aliases of /dev/null, so jobs asking --gpus-per-node are
# scheduled as on a GPU cluster while the ranks run on CPU (gloo).
#
# Everything lives in DIR (config, munge key and socket, state, logs, PIDs); nothing in /etc is
# touched and ports are chosen free, so several instances can coexist. `start` prints the line to
# use it, `export SLURM_CONF=DIR/slurm.conf`, once both nodes are idle. `stop` ends exactly the
# daemons it started, by the PIDs recorded in DIR/pids.
set -euo pipefail

die() { echo "local_slurm: $*" >&2; exit 2; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v sbatch >/dev/null && return
  [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are not installed and installing them needs root"
  command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed and there is no apt-get"
  echo "local_slurm: installing slurm-wlm and munge (Debian packages)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >&2
}

free_port() {  # a TCP port nothing listens on (bash's /dev/tcp connects or fails)
  local port
  for _ in $(seq 100); do
    port=$((20000 + RANDOM % 20000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then echo "$port"; return; fi
  done
  die "no free TCP port found"
}

write_config() {
  local dir="$1" gpus="$2" ctld_port node_port node gres_line="" gres_types=""
  NODES=("$(hostname -s)" localhost)
  [ "${NODES[0]}" != localhost ] || die "this host's short name is 'localhost'; two node names are needed"
  mkdir -p "$dir"/{state,log,dev,munge}
  : >"$dir/gres.conf"
  if [ "$gpus" -gt 0 ]; then
    gres_types="GresTypes=gpu"
    gres_line="Gres=gpu:$gpus"
    echo "AutoDetect=off" >>"$dir/gres.conf"
    for node in "${NODES[@]}"; do
      for i in $(seq 0 $((gpus - 1))); do
        [ -e "$dir/dev/$node-gpu$i" ] || mknod "$dir/dev/$node-gpu$i" c 1 3  # /dev/null's numbers
        echo "NodeName=$node Name=gpu File=$dir/dev/$node-gpu$i" >>"$dir/gres.conf"
      done
    done
  fi
  ctld_port=$(free_port)
  cat >"$dir/slurm.conf" <<EOF
ClusterName=localci
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket.2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MinJobAge=3600
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
$gres_types
EOF
  for node in "${NODES[@]}"; do
    node_port=$(free_port)
    echo "NodeName=$node NodeAddr=127.0.0.1 Port=$node_port CPUs=$(nproc) RealMemory=1000 $gres_line State=UNKNOWN" >>"$dir/slurm.conf"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$dir/slurm.conf"
}

start_munge() {
  local dir="$1"
  # munged checks that its key and socket directories belong to the user it runs as.
  [ -f "$dir/munge/munge.key" ] || dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chown -R munge: "$dir/munge"
  chmod 755 "$dir/munge"  # clients need to reach the socket
  chmod 400 "$dir/munge/munge.key"
  runuser -u munge -- munged --foreground --key-file="$dir/munge/munge.key" \
    --socket="$dir/munge/munge.socket.2" --pid-file="$dir/munge/munged.pid" \
    --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" \
    >>"$dir/log/munged.out" 2>&1 &
  echo "munged $!" >>"$dir/pids"
  for _ in $(seq 50); do [ -S "$dir/munge/munge.socket.2" ] && return; sleep 0.1; done
  stop "$dir"
  die "munged did not create its socket; see $dir/log/munged.out"
}

start() {
  local dir="$1" gpus="${2:-4}" node
  install_packages
  [ ! -s "$dir/pids" ] || die "$dir already has running daemons ($dir/pids); stop them first"
  mkdir -p "$dir" && dir="$(cd "$dir" && pwd)"
  chmod 755 "$dir"  # munged runs as the munge user: it must reach its key and socket in here
  runuser -u munge -- test -x "$dir" || die "the munge user cannot enter $dir (a parent directory is closed to other users); use a directory under /tmp"
  write_config "$dir" "$gpus"
  export SLURM_CONF="$dir/slurm.conf"
  start_munge "$dir"
  slurmctld -D -i -f "$SLURM_CONF" >>"$dir/log/slurmctld.out" 2>&1 &
  echo "slurmctld $!" >>"$dir/pids"
  for node in "${NODES[@]}"; do
    mkdir -p "$dir/spool/$node"
    slurmd -D -N "$node" -f "$SLURM_CONF" >>"$dir/log/slurmd.$node.out" 2>&1 &
    echo "slurmd $!" >>"$dir/pids"
  done
  for _ in $(seq 150); do  # both nodes idle: ready for jobs (~10 s)
    if [ "$(sinfo -h -N -o '%t' 2>/dev/null | grep -c '^idle')" = 2 ]; then
      echo "export SLURM_CONF=$SLURM_CONF"
      return
    fi
    sleep 0.2
  done
  sinfo -N -l >&2 || true
  tail -n 5 "$dir"/log/*.log >&2 || true
  stop "$dir"
  die "the two nodes did not become idle within 30 s; logs in $dir/log"
}

stop() {
  local dir="$1" name pid
  [ -f "$dir/pids" ] || { echo "local_slurm: nothing started in $dir" >&2; return 0; }
  # Daemons first, munge last (they talk to it while shutting down).
  tac "$dir/pids" | while read -r name pid; do
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { echo "local_slurm: $name ($pid) ignored SIGTERM; SIGKILL" >&2; kill -9 "$pid" 2>/dev/null || true; }
  done
  rm -f "$dir/pids"
}

status() {
  local dir="$1" name pid
  [ -f "$dir/pids" ] || { echo "not started"; return 1; }
  while read -r name pid; do
    if kill -0 "$pid" 2>/dev/null; then echo "$name $pid running"; else echo "$name $pid gone"; fi
  done <"$dir/pids"
  SLURM_CONF="$dir/slurm.conf" sinfo -N
}

[ $# -ge 2 ] || die "usage: $0 start DIR [GPUS_PER_NODE] | stop DIR | status DIR"
case "$1" in
  start) start "$2" "${3:-4}" ;;
  stop) stop "$2" ;;
  status) status "$2" ;;
  *) die "unknown command '$1'; expected start, stop or status" ;;
esac
