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
# nodes in the job     --nnodes N        NNODES           1; MIN:MAX (1:2) for an elastic job, see below
# this node's rank     --node-rank R     NODE_RANK        0 (used by --rdzv static; c10d numbers nodes itself)
# node 0's address     --master-addr A   MASTER_ADDR      127.0.0.1 (must be reachable from every node)
# its port             --master-port P   MASTER_PORT      29500 (a free one when NNODES=1; --slurm: from the job)
# processes per node   --nproc-per-node  NPROC_PER_NODE   the number of GPUs, or 1 without any
# rendezvous           --rdzv c10d|static RDZV            c10d: elastic, recommended; static: fixed node ranks
# job id (c10d)        --rdzv-id ID      RDZV_ID          ddp_train; the same on every node, unique per job
# network interface    --ifname IF       IFNAME           unset; sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME
# wait for all nodes   --timeout S       TIMEOUT          300 seconds, for the rendezvous (and, if given, ddp_train.py's --timeout)
# restarts             --max-restarts K  MAX_RESTARTS     0 (elastic: 3); after a failure all workers restart and resume
# last call (elastic)  --last-call S     LAST_CALL        30 s: how long a rendezvous waits for more than MIN nodes
# time to save         --shutdown-timeout S SHUTDOWN_TIMEOUT 120 s after a stop signal (torchrun's own default: 30)
# training script      --script PATH     SCRIPT           ddp_train.py beside this file; or your own that imports it
# Anything else, or everything after --, goes to ddp_train.py. PYTHON picks the interpreter. Its --out-dir
# is by default out/SCRIPT in each node's working directory (out/ddp_train; make train-multinode:
# out/train-multinode/ddp_train): across nodes give one on storage that every node shares.
#
# Elastic: NNODES=1:2 runs with whatever nodes are there, from MIN to MAX. A node that is lost (killed,
# or cut off: noticed within --timeout) costs the steps since the last checkpoint and one rendezvous:
# the survivors restart their workers, which resume at the smaller world size. A node that joins makes
# the running ones stop at the next step, save, and resume with it. The run keeps its global batch on
# every world size (more or fewer micro-batches a step). The node at MASTER_ADDR hosts the rendezvous: it
# must stay. Each restart after a failure costs one of MAX_RESTARTS; a join costs none.
#
# Timeouts: every node waits up to TIMEOUT (300 s) for node 0's port and for all nodes to join; a TIMEOUT
# you set is also ddp_train.py's --timeout for a collective (else its own default, 30 min, which a cold
# --compile on one rank fits in, and after which a node cut off from the network is given up). A stop signal (SIGTERM, SIGUSR1, SIGINT, SIGHUP) goes to
# torchrun, which passes it to the workers and gives them SHUTDOWN_TIMEOUT (120 s; torchrun's
# --shutdown-timeout) to checkpoint and exit before SIGKILL; this script SIGKILLs a torchrun that is
# still running 15 s after that. The workers exit 75 once their checkpoint is saved, torchrun and this
# script 1. (To stop its workers for a restart, as when a node joins, torchrun keeps its own 30 s.) On
# SLURM, scancel, a requeue and the time limit send SIGKILL KillWait seconds (default 30) after their
# SIGTERM, whatever SHUTDOWN_TIMEOUT is: see docs/multi-node.md. It prints the timeouts and the exact
# torchrun command on stderr before it starts.
#
# SLURM: `--slurm` takes NNODES, NODE_RANK, RDZV_ID and NPROC_PER_NODE from the job step, MASTER_ADDR
# from the first host of the step's nodes, and MASTER_PORT from the job and step ids. One torchrun per
# node, started by srun. The batch script the tests run (on GPU nodes add e.g. --gpus-per-node=8):
#
#   #!/bin/bash
#   #SBATCH --nodes=2 --ntasks-per-node=1
#   #SBATCH --signal=USR1@120   # 2 minutes before the time limit: every worker checkpoints and stops
#   #SBATCH --requeue --open-mode=append   # a requeued run appends to the log instead of replacing it
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
# A stop signal goes to torchrun, which passes it to the workers and gives them SHUTDOWN_TIMEOUT. SLURM
# and a terminal signal torchrun themselves; if torchrun does not say within a second that it got it (a
# `kill` of this script alone), it is passed on (a second one would abort torchrun's shutdown). A
# torchrun blocked on a node that left the network cannot act on it: it gets SIGKILL SHUTDOWN_TIMEOUT
# + 15 s later.
# Before torchrun runs there is nothing to save: exit 75 (130 after Ctrl-C), "run again".
pid='' signalled='' forward_in='' kill_at=''
on_signal() {
  if [[ -z "$pid" ]]; then
    echo "run_multi_node.sh: SIG$1 before torchrun started; nothing to save, run again to start" >&2
    exit "$([[ $1 == INT ]] && echo 130 || echo 75)"
  fi
  signalled=$1 forward_in=5 kill_at=$((SECONDS + SHUTDOWN_TIMEOUT + 15))  # 5 turns of the loop below
}
for sig in TERM INT HUP USR1; do trap "on_signal $sig" "$sig"; done

first_host() {  # first host of a SLURM node list: "gpu[07-09,12]-ib,cpu1" -> gpu07-ib (as ddp_train.py's)
  local hosts  # scontrol knows every spelling, but needs a configured cluster; else parse it here
  if hosts=$(scontrol show hostnames "$1" 2>/dev/null) && [[ -n "$hosts" ]]; then echo "${hosts%%$'\n'*}"; return; fi
  local head=${1%%,*}
  if [[ "$1" =~ ^([^,\[]*)\[([0-9]+)[^]]*\]([^,]*) ]]; then head="${BASH_REMATCH[1]}${BASH_REMATCH[2]}${BASH_REMATCH[3]}"; fi
  echo "$head"
}

master_addr_given=${MASTER_ADDR:+yes} slurm=''
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
    --timeout) TIMEOUT=$2; timeout_given=yes; shift 2 ;;
    --max-restarts) MAX_RESTARTS=$2; shift 2 ;;
    --last-call) LAST_CALL=$2; shift 2 ;;
    --shutdown-timeout) SHUTDOWN_TIMEOUT=$2; shift 2 ;;
    --script) SCRIPT=$2; shift 2 ;;
    --slurm)
      [[ -n "${SLURM_JOB_ID:-}" && -n "${SLURM_NODEID:-}" ]] || die "--slurm: not inside a SLURM job step (run it with srun)"
      # The step's own variables win over the job's: a step may run on part of the allocation.
      NNODES=${SLURM_STEP_NUM_NODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}
      (( ${SLURM_STEP_NUM_TASKS:-$NNODES} <= NNODES )) ||
        die "--slurm starts one torchrun per node, but this step has $SLURM_STEP_NUM_TASKS tasks on $NNODES node(s): use srun --ntasks-per-node=1"
      NODE_RANK=$SLURM_NODEID  # relative to the step, like its node list
      MASTER_ADDR=$(first_host "${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-${SLURM_NODELIST:?}}}"); master_addr_given=yes
      RDZV_ID=${RDZV_ID:-slurm-$SLURM_JOB_ID}
      [[ -n "${SLURM_GPUS_ON_NODE:-}" ]] && NPROC_PER_NODE=${NPROC_PER_NODE:-$SLURM_GPUS_ON_NODE}
      slurm=yes; shift ;;
    --) shift; train_args+=("$@"); break ;;
    *) train_args+=("$1"); shift ;;
  esac
done

# --slurm: two jobs (or two steps of one job) on one node need two ports, and all nodes of a step must
# agree without talking: 61000-65499 is above Linux's ephemeral ports (32768-60999), where no outgoing
# connection takes it by chance (ddp_train.py picks a bare srun's port by the same rule);
# job id x 11 + step id: 4500 consecutive jobs' first steps all differ, and so do the first 11 steps of
# neighbouring jobs (11 is prime to 4500). A requeued job keeps its id: its restart count moves it to
# another port, as the previous run's last processes may still hold the old one for a few seconds.
if [[ -n "$slurm" && -z "${MASTER_PORT:-}" ]]; then
  MASTER_PORT=$(( 61000 + (SLURM_JOB_ID * 11 + ${SLURM_STEP_ID:-0} + 2221 * ${SLURM_RESTART_COUNT:-0}) % 4500 ))
fi
NNODES=${NNODES:-1}
[[ "$NNODES" =~ ^([0-9]+):([0-9]+)$ ]] && elastic=yes || elastic=''
MAX_NODES=${NNODES#*:}  # the most nodes: NNODES itself, or MAX of MIN:MAX
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV=${RDZV:-c10d}
RDZV_ID=${RDZV_ID:-ddp_train}
timeout_given=${TIMEOUT:+yes}  # then ddp_train.py waits as long in its collectives; else its own default (30 min)
TIMEOUT=${TIMEOUT:-300}
MAX_RESTARTS=${MAX_RESTARTS:-$([[ -n "$elastic" ]] && echo 3 || echo 0)}
LAST_CALL=${LAST_CALL:-30}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-120}
SCRIPT=${SCRIPT:-$here/ddp_train.py}
[[ -f "$SCRIPT" ]] || die "--script $SCRIPT: no such file"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')
fi
for v in MAX_NODES NODE_RANK MASTER_PORT NPROC_PER_NODE TIMEOUT MAX_RESTARTS LAST_CALL SHUTDOWN_TIMEOUT; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a whole number, got '${!v}'"
done
if [[ -n "$elastic" ]]; then
  (( ${NNODES%:*} >= 1 && ${NNODES%:*} <= MAX_NODES )) || die "NNODES $NNODES: MIN:MAX with 1 <= MIN <= MAX"
  [[ "$RDZV" == c10d ]] || die "NNODES $NNODES is elastic: it needs --rdzv c10d"
fi
(( NODE_RANK < MAX_NODES )) || die "NODE_RANK $NODE_RANK is not below NNODES $NNODES"
(( MAX_NODES == 1 )) || [[ -n "$master_addr_given" ]] || die "NNODES is $NNODES: set MASTER_ADDR to node 0's address (the same on every node)"
# What torchrun's environment gets from here (printed with its command).
# A script of your own imports ddp_train: the one beside this file, unless its own directory has one.
envs=(PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}")
if [[ -n "${IFNAME:-}" ]]; then
  # The interface that carries traffic between nodes (see `ip -brief addr`): without it gloo and
  # NCCL may pick one that other nodes cannot reach (docker0, a VPN) and hang at init.
  envs+=(GLOO_SOCKET_IFNAME="$IFNAME" NCCL_SOCKET_IFNAME="$IFNAME")
fi
# A node that joins a running job (elastic, or a node whose torchrun started again) needs a store of
# its round: in torch's shared store, its torchrun waits for the round's address, which only the first
# round's rank 0 writes. A fresh store per round, hosted by the new rank 0, lets any node join.
[[ "$MAX_NODES" -gt 1 && "$RDZV" == c10d ]] && envs+=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}")
# torchrun forwards only the signals its --signals-to-handle names (PET_SIGNALS_TO_HANDLE; torch >= 2.9),
# and SLURM's --signal=USR1 is not among its defaults: without it, USR1 kills torchrun before the
# workers save. (It overwrites TORCHELASTIC_SIGNALS_TO_HANDLE with that option's value.)
envs+=(PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}")

# Preflight, so the common mistakes get one clear line instead of a hang or a traceback.
# The machine that owns MASTER_ADDR hosts the rendezvous, and its port must be free; every other
# node waits (up to TIMEOUT) until it can connect to MASTER_ADDR:MASTER_PORT. Either way we learn
# this node's address as the others see it, and tell torchrun (no reliance on hostname lookups).
role='' local_addr=''
if [[ -n "$master_addr_given" ]]; then
  verdict=$("$PYTHON" - "$MASTER_ADDR" "$MASTER_PORT" "$TIMEOUT" <<'PY'
import errno, socket, sys, time
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    addr = socket.gethostbyname(host)
except OSError:
    sys.exit(print(f"MASTER_ADDR {host} does not resolve to an address"))
with socket.socket() as s:
    # As TCPStore does: a port whose last connections linger in TIME_WAIT (a run that just ended, a
    # requeued job) is free; one that something listens on is not.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
        sys.exit(print("host", addr))  # this machine owns MASTER_ADDR and the port is free
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            sys.exit(print(f"port {port} on {host} is already in use (another job, or an earlier run still "
                           "alive): choose another MASTER_PORT"))
deadline = time.monotonic() + timeout
while True:
    try:
        with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))) as c:
            sys.exit(print("client", c.getsockname()[0]))
    except OSError:
        if time.monotonic() >= deadline:
            sys.exit(print(f"cannot reach MASTER_ADDR {host} ({addr}) port {port} within {timeout:g}s: is node 0 "
                           "started, is this its address as the other nodes see it, is the port open?"))
        time.sleep(0.2)
PY
)
  read -r role local_addr <<<"$verdict"
  case "$role" in
    host) [[ "$RDZV" != static || "$NODE_RANK" == 0 ]] ||
            die "NODE_RANK is $NODE_RANK, but this machine owns MASTER_ADDR $MASTER_ADDR: node 0 must run here" ;;
    client) [[ "$RDZV" != static || "$NODE_RANK" != 0 ]] ||
            die "NODE_RANK is 0, but MASTER_ADDR $MASTER_ADDR is another machine: run node 0 on the machine at MASTER_ADDR" ;;
    *) die "$verdict" ;;
  esac
  # gloo advertises the address this machine's hostname resolves to. If that is a loopback address,
  # the other nodes would dial themselves: the interface must be named.
  if (( MAX_NODES > 1 )) && [[ -z "${IFNAME:-}${GLOO_SOCKET_IFNAME:-}" ]] &&
     "$PYTHON" -c 'import socket, sys; sys.exit(not socket.gethostbyname(socket.gethostname()).startswith("127."))'; then
    dev=$(ip -o -4 addr show 2>/dev/null | awk -v a="$local_addr" 'index($4, a "/") == 1 {print $2}')
    die "this machine's hostname ($(hostname)) resolves to a loopback address, which other nodes cannot reach: set IFNAME=${dev:-<interface>} (the interface with $local_addr)"
  fi
fi

launch=(--nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS")
# torchrun's --shutdown-timeout is torch 2.12's and its --signals-to-handle 2.10's. An older torchrun SIGKILLs its
# workers 30 s after a stop signal, and a SIGUSR1 ends it at once: say so, and go on.
torchrun_help=$("$PYTHON" -m torch.distributed.run --help 2>/dev/null || true)
if [[ "$torchrun_help" == *--shutdown-timeout* ]]; then
  launch+=(--shutdown-timeout="$SHUTDOWN_TIMEOUT")
else
  SHUTDOWN_TIMEOUT=30
  echo "run_multi_node.sh: this torchrun has no --shutdown-timeout (torch 2.12+): after a stop signal the workers get" \
       "30 s to save their checkpoint, then SIGKILL; a longer save needs torch 2.12 or later$([[ "$torchrun_help" == \
       *--signals-to-handle* ]] || echo ". It also dies of SIGUSR1 (torch 2.10+ forwards it): stop it with SIGTERM")" >&2
fi
[[ -n "$local_addr" ]] && launch+=(--local-addr="$local_addr")
if [[ "$MAX_NODES" == 1 && -z "$master_addr_given" ]]; then
  launch+=(--standalone)  # one node: a free port, so two runs on one machine never collide
elif [[ "$RDZV" == c10d ]]; then
  launch+=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID"
           --rdzv-conf="join_timeout=$TIMEOUT,read_timeout=$TIMEOUT,is_host=$([[ $role == host ]] && echo 1 || echo 0)${elastic:+,last_call_timeout=$LAST_CALL}")
elif [[ "$RDZV" == static ]]; then
  launch+=(--node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT"
           --rdzv-conf="timeout=$TIMEOUT")
else
  die "--rdzv must be c10d or static, got '$RDZV'"
fi
cmd=("$PYTHON" -m torch.distributed.run "${launch[@]}" "$SCRIPT" ${timeout_given:+--timeout "$TIMEOUT"} "${train_args[@]}")
echo "run_multi_node.sh: $NNODES node(s) x $NPROC_PER_NODE process(es); timeouts: ${TIMEOUT}s for all nodes to" \
     "join, then after a stop signal ${SHUTDOWN_TIMEOUT}s for the workers to save (torchrun) and SIGKILL to" \
     "torchrun at $((SHUTDOWN_TIMEOUT + 15))s" >&2
line=$(printf '%q ' "${envs[@]}" "${cmd[@]}")
echo "run_multi_node.sh: ${line% }" >&2

# Run torchrun in the background so that stop signals reach it (and, through it, the workers)
# and a failure ends with one line saying what it most likely means. SLURM signals every process
# of the step, the tee too: it ignores them, so that torchrun's last words still reach the log.
errlog=$(mktemp "${TMPDIR:-/tmp}/run_multi_node.XXXXXX")
trap 'rm -f "$errlog"' EXIT
exec 3> >(trap '' TERM INT HUP USR1; exec tee "$errlog" >&2)
tee_pid=$!
env "${envs[@]}" "${cmd[@]}" 2>&3 3>&- &
pid=$!
exec 3>&-
while kill -0 "$pid" 2>/dev/null; do
  if [[ -n "$forward_in" ]] && (( --forward_in <= 0 )); then
    grep -q "death signal" "$errlog" || kill "-$signalled" "$pid" 2>/dev/null || true
    forward_in=
  fi
  if [[ -n "$kill_at" ]] && (( SECONDS >= kill_at )); then kill -KILL "$pid" 2>/dev/null || true; fi
  sleep 0.2 & wait $! 2>/dev/null || true
done
code=0; wait "$pid" || code=$?
# Let tee write the last of torchrun's stderr (2 s at most: a stray worker may hold the pipe open).
for _ in {1..10}; do kill -0 "$tee_pid" 2>/dev/null || break; sleep 0.2; done
if (( code != 0 )) && [[ -z "$signalled" ]]; then
  if grep -q "death signal" "$errlog"; then
    why="torchrun was stopped by a signal; rerun the same command to continue from the last checkpoint"
  elif grep -q "RendezvousTimeoutError" "$errlog"; then
    why="not all $NNODES nodes joined within ${TIMEOUT}s: start the same command on every node (same NNODES, MASTER_ADDR, MASTER_PORT, RDZV_ID)"
  elif grep -qE "RendezvousConnectionError|DistNetworkError|trying to connect to" "$errlog" && ! grep -q "ddp_train.py: " "$errlog"; then
    why="could not connect to the rendezvous at $MASTER_ADDR:$MASTER_PORT (see above)"
  elif grep -qE "lost contact with|Connection closed by peer|Connection reset by peer|Timed out waiting" "$errlog"; then
    why="a worker on another node stopped (crashed, was killed, or left the network). Rerun the same command on every node to resume from the last checkpoint"
  else
    why="torchrun exited with code $code; the first error above is the cause"
  fi
  echo "run_multi_node.sh: $why" >&2
fi
exit "$code"
