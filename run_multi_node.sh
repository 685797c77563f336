#!/usr/bin/env bash
# ddp_train.py on one node of a (multi-node) job: one torchrun per node.
#
# Two machines, every setting the same on both except NODE_RANK:
#   host0$ NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_multi_node.sh --epochs 10
#   host1$ NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./run_multi_node.sh --epochs 10
# The same with arguments:
#   host1$ ./run_multi_node.sh --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 -- --epochs 10
#
# Setting              argument          environment      default
# nodes in the job     --nnodes N        NNODES           1
# this node's rank     --node-rank R     NODE_RANK        0 (used by --rdzv static; c10d numbers nodes itself)
# node 0's address     --master-addr A   MASTER_ADDR      127.0.0.1 (must be reachable from every node)
# its port             --master-port P   MASTER_PORT      29500 (a free one when NNODES=1)
# processes per node   --nproc-per-node  NPROC_PER_NODE   the number of GPUs, or 1 without any
# rendezvous           --rdzv c10d|static RDZV            c10d: elastic, recommended; static: fixed node ranks
# job id (c10d)        --rdzv-id ID      RDZV_ID          ddp_train; the same on every node, unique per job
# network interface    --ifname IF       IFNAME           unset; sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME
# wait for all nodes   --timeout S       TIMEOUT          300 seconds, for the rendezvous and ddp_train.py's --timeout
# restarts             --max-restarts K  MAX_RESTARTS     0; after a failure all workers restart and resume
# Anything else, or everything after --, goes to ddp_train.py. PYTHON picks the interpreter.
#
# SLURM: `--slurm` takes NNODES, NODE_RANK, RDZV_ID and NPROC_PER_NODE from the job, and MASTER_ADDR
# from the first host of SLURM_JOB_NODELIST. One torchrun per node, started by srun:
#
#   #!/bin/bash
#   #SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --cpus-per-task=32
#   #SBATCH --signal=USR1@120   # 2 minutes before the time limit: every worker checkpoints and stops
#   #SBATCH --requeue
#   srun ./run_multi_node.sh --slurm -- --out-dir /shared/runs/$SLURM_JOB_ID
#   # Not finished (stopped by the signal, or a node failed)? Continue in a new allocation from the checkpoint.
#   [ -f /shared/runs/$SLURM_JOB_ID/model.pt ] || [ "${SLURM_RESTART_COUNT:-0}" -ge 5 ] || scontrol requeue "$SLURM_JOB_ID"
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  [[ -x "$here/.venv/bin/python" ]] && PYTHON="$here/.venv/bin/python"
fi
die() { echo "run_multi_node.sh: $*" >&2; exit 2; }

first_host() {  # first host of a SLURM node list: "gpu[07-09,12],cpu1" -> gpu07
  if command -v scontrol >/dev/null 2>&1; then scontrol show hostnames "$1" | head -n 1; return; fi
  local head=${1%%,*}
  if [[ "$1" =~ ^([^,\[]*)\[([0-9]+) ]]; then head="${BASH_REMATCH[1]}${BASH_REMATCH[2]}"; fi
  echo "$head"
}

master_addr_given=${MASTER_ADDR:+yes}
train_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nnodes) NNODES=$2; shift 2 ;;
    --node-rank) NODE_RANK=$2; shift 2 ;;
    --master-addr) MASTER_ADDR=$2; master_addr_given=yes; shift 2 ;;
    --master-port) MASTER_PORT=$2; shift 2 ;;
    --nproc-per-node) NPROC_PER_NODE=$2; shift 2 ;;
    --rdzv) RDZV=$2; shift 2 ;;
    --rdzv-id) RDZV_ID=$2; shift 2 ;;
    --ifname) IFNAME=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --max-restarts) MAX_RESTARTS=$2; shift 2 ;;
    --slurm)
      [[ -n "${SLURM_JOB_ID:-}" && -n "${SLURM_NODEID:-}" ]] || die "--slurm: not inside a SLURM job step (run it with srun)"
      NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
      NODE_RANK=$SLURM_NODEID
      MASTER_ADDR=$(first_host "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:?}}"); master_addr_given=yes
      RDZV_ID=${RDZV_ID:-slurm-$SLURM_JOB_ID}
      [[ -n "${SLURM_GPUS_ON_NODE:-}" ]] && NPROC_PER_NODE=${NPROC_PER_NODE:-$SLURM_GPUS_ON_NODE}
      shift ;;
    --) shift; train_args+=("$@"); break ;;
    *) train_args+=("$1"); shift ;;
  esac
done

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV=${RDZV:-c10d}
RDZV_ID=${RDZV_ID:-ddp_train}
TIMEOUT=${TIMEOUT:-300}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')
fi
for v in NNODES NODE_RANK MASTER_PORT NPROC_PER_NODE TIMEOUT MAX_RESTARTS; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a whole number, got '${!v}'"
done
(( NODE_RANK < NNODES )) || die "NODE_RANK $NODE_RANK is not below NNODES $NNODES"
if [[ -n "${IFNAME:-}" ]]; then
  # The interface that carries traffic between nodes (see `ip -brief addr`): without it gloo and
  # NCCL may pick one that other nodes cannot reach (docker0, a VPN) and hang at init.
  export GLOO_SOCKET_IFNAME=$IFNAME NCCL_SOCKET_IFNAME=$IFNAME
fi
# Forward SLURM's --signal=USR1 to the workers too, as torchrun does for SIGTERM.
export TORCHELASTIC_SIGNALS_TO_HANDLE=${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}

launch=(--nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS")
if [[ "$NNODES" == 1 && -z "$master_addr_given" ]]; then
  launch+=(--standalone)  # one node: a free port, so two runs on one machine never collide
elif [[ "$RDZV" == c10d ]]; then
  launch+=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID"
           --rdzv-conf="join_timeout=$TIMEOUT")
elif [[ "$RDZV" == static ]]; then
  launch+=(--node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT"
           --rdzv-conf="timeout=$TIMEOUT")
else
  die "--rdzv must be c10d or static, got '$RDZV'"
fi
exec "$PYTHON" -m torch.distributed.run "${launch[@]}" "$here/ddp_train.py" --timeout "$TIMEOUT" "${train_args[@]}"
