#!/usr/bin/env bash
# Start (or stop) a SLURM cluster of NODES nodes, all on this machine, with fake GPUs, for tests
# of --gpu-nodes=slurm (a variant of slurm-single-node.sh).
#
#   slurm-nodes.sh start DIR [NODES] [NGPUS] [CPUS] [PORT]   # prints: export SLURM_CONF=DIR/slurm.conf
#   slurm-nodes.sh stop DIR
#
# The nodes are n1..nNODES, one slurmd each (`slurmd -N nX`, Debian's slurmd 22.05 accepts
# it), all on 127.0.0.1 with ports PORT+1..PORT+NODES; slurmctld listens on PORT (default
# 6837), so this cluster runs beside slurm-single-node.sh's (SLURM's default ports 6817/6818).
# Every node has NGPUS fake GPUs and CPUS CPUs.
#
# Needs root and Debian's packages: slurmctld slurmd slurm-client munge
# (apt-get install -y slurmctld slurmd slurm-client munge). No systemd is needed:
# munged, slurmctld and slurmd are started here as background processes whose ids
# are kept in DIR, and `stop` ends exactly those.
#
# Fake GPUs are character devices (same numbers as /dev/null); SLURM then sets
# CUDA_VISIBLE_DEVICES for jobs that ask for --gres=gpu:N. There are no cgroups here,
# so jobs are not confined to their devices: the indices are what SLURM granted.
# CPUS is declared (config_overrides) so that more jobs than real cores can run at once.
set -euo pipefail

cmd=${1:?usage: start DIR [NODES] [NGPUS] [CPUS] [PORT] | stop DIR}
dir=${2:?usage: start DIR [NODES] [NGPUS] [CPUS] [PORT] | stop DIR}

stop() {
  for f in "$dir"/slurmd-*.bgpid "$dir/ctld.bgpid" "$dir/munged.bgpid"; do
    if [ -s "$f" ]; then kill "$(cat "$f")" 2>/dev/null || true; rm -f "$f"; fi
  done
}

case "$cmd" in
stop) stop; exit 0 ;;
start) ;;
*) echo "unknown command: $cmd" >&2; exit 2 ;;
esac

nodes=${3:-2}
ngpus=${4:-2}
cpus=${5:-4}
port=${6:-6837}
host=$(hostname -s)
mkdir -p "$dir"/{spool,state,dev,munge}
dir=$(cd "$dir" && pwd)

for bin in slurmctld slurmd sinfo srun munged; do
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || { echo "missing $bin: apt-get install -y slurmctld slurmd slurm-client munge" >&2; exit 3; }
done

# munge: its own socket and key inside DIR, so nothing system-wide is touched.
chown munge:munge "$dir/munge"
if [ ! -s "$dir/munge/munge.key" ]; then
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chown munge:munge "$dir/munge/munge.key"; chmod 600 "$dir/munge/munge.key"
fi
runuser -u munge -- /usr/sbin/munged --foreground --key-file="$dir/munge/munge.key" \
  --socket="$dir/munge/munge.socket" --pid-file="$dir/munge/munged.pid" \
  --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" \
  > "$dir/munge/munged.out" 2>&1 &
echo $! > "$dir/munged.bgpid"
for _ in $(seq 1 50); do [ -S "$dir/munge/munge.socket" ] && break; sleep 0.1; done

last=$((ngpus - 1))
for i in $(seq 0 "$last"); do [ -e "$dir/dev/nvidia$i" ] || mknod "$dir/dev/nvidia$i" c 1 3; done

cat > "$dir/slurm.conf" <<EOC
ClusterName=nodes
SlurmctldHost=$host
SlurmctldPort=$port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdSpoolDir=$dir/spool/%n
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOC
for i in $(seq 1 "$nodes"); do
  echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port + i)) CPUs=$cpus RealMemory=16000 Gres=gpu:$ngpus State=UNKNOWN" >> "$dir/slurm.conf"
  mkdir -p "$dir/spool/n$i"
done
printf 'AutoDetect=off\nName=gpu File=%s/dev/nvidia[0-%d]\n' "$dir" "$last" > "$dir/gres.conf"

export SLURM_CONF="$dir/slurm.conf"
slurmctld -D -f "$SLURM_CONF" > "$dir/ctld.out" 2>&1 & echo $! > "$dir/ctld.bgpid"
for i in $(seq 1 "$nodes"); do
  slurmd -D -N "n$i" -f "$SLURM_CONF" > "$dir/slurmd-n$i.out" 2>&1 & echo $! > "$dir/slurmd-n$i.bgpid"
done
for _ in $(seq 1 100); do
  [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = "$nodes" ] && { echo "export SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.2
done
echo "SLURM did not become idle; logs in $dir" >&2
stop
exit 1
