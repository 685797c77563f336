#!/usr/bin/env bash
# This script runs ddp_train.py on one node of a job, and the job may have several nodes. Each node runs
# one torchrun.
#
# The two commands below run a job on two machines. Every setting is the same on both, except NODE_RANK.
#   host0$ NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_multi_node.sh --epochs 10
#   host1$ NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./run_multi_node.sh --epochs 10
# The next command gives host1 the same settings as arguments.
#   host1$ ./run_multi_node.sh --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 -- --epochs 10
#
# Setting              argument          environment      default
# nodes in the job     --nnodes N        NNODES           1. An elastic job takes MIN:MAX, such as 1:2.
#                                                         A paragraph below explains elastic jobs.
# this node's rank     --node-rank R     NODE_RANK        0. Only --rdzv static uses it.
#                                                         c10d numbers the nodes itself.
# node 0's address     --master-addr A   MASTER_ADDR      127.0.0.1. Every node must be able to reach it.
# its port             --master-port P   MASTER_PORT      29500. With NNODES=1, it is a free port.
#                                                         --slurm takes the port from the job.
# processes per node   --nproc-per-node  NPROC_PER_NODE   the number of GPUs, or 1 if the node has none
# rendezvous           --rdzv c10d|static RDZV            c10d, which is elastic and recommended.
#                                                         static uses fixed node ranks.
# job id (c10d)        --rdzv-id ID      RDZV_ID          ddp_train. It is the same on every node.
#                                                         Each job needs an id of its own.
# network interface    --ifname IF       IFNAME           unset. It sets GLOO_SOCKET_IFNAME and
#                                                         NCCL_SOCKET_IFNAME.
# wait for all nodes   --timeout S       TIMEOUT          300 seconds for the rendezvous.
#                                                         A TIMEOUT you set is also ddp_train.py's --timeout.
# restarts             --max-restarts K  MAX_RESTARTS     0, or 3 for an elastic job.
#                                                         After a failure, all workers restart and resume.
# last call (elastic)  --last-call S     LAST_CALL        30 s. A rendezvous waits this long for more
#                                                         than MIN nodes.
# time to save         --shutdown-timeout S SHUTDOWN_TIMEOUT 120 s after a stop signal.
#                                                         torchrun's own default is 30 s.
# training script      --script PATH     SCRIPT           ddp_train.py beside this file. It may also be
#                                                         your own script that imports it.
# Any other argument goes to ddp_train.py, and so does everything after --. PYTHON picks the interpreter.
# The default --out-dir of ddp_train.py is out/SCRIPT in each node's working directory, such as
# out/ddp_train. make train-multinode uses out/train-multinode/ddp_train. A job across nodes needs an
# --out-dir on storage that every node shares.
#
# An elastic job, such as NNODES=1:2, runs with whatever nodes are there, from MIN to MAX. A node may be
# lost because it was killed or cut off. A node that is cut off is noticed within --timeout. A lost node
# costs the steps since the last checkpoint and one rendezvous. The survivors restart their workers, which
# resume at the smaller world size. A node that joins makes the running nodes stop at the next step and
# save. Then they resume together with the new node. The run keeps its global batch on every world size,
# and so it takes more or fewer micro-batches a step. The node at MASTER_ADDR hosts the rendezvous, so it
# must stay. Each restart after a failure uses up one of MAX_RESTARTS, but a join uses none.
#
# Every node waits up to TIMEOUT for node 0's port and for all nodes to join. TIMEOUT is 300 s by default.
# A TIMEOUT that you set is also ddp_train.py's --timeout for a collective. Without it, ddp_train.py uses
# its own default of 30 min. A cold --compile on one rank fits in that time. After that time, ddp_train.py
# gives up a node that is cut off from the network.
#
# A stop signal is SIGTERM, SIGUSR1, SIGINT or SIGHUP. It goes to torchrun, which passes it to the
# workers. torchrun gives them SHUTDOWN_TIMEOUT to checkpoint and exit, and then it sends SIGKILL.
# SHUTDOWN_TIMEOUT is 120 s by default, and it sets torchrun's --shutdown-timeout. This script sends
# SIGKILL to a torchrun that is still running 15 s after that. The workers exit 75 once their checkpoint
# is saved, and torchrun and this script exit 1. When torchrun stops its workers for a restart, as when a
# node joins, it keeps its own 30 s. On SLURM, scancel, a requeue and the time limit send SIGTERM first.
# They send SIGKILL KillWait seconds later, whatever SHUTDOWN_TIMEOUT is. KillWait is 30 by default.
# docs/multi-node.md explains this. Before this script starts torchrun, it prints the timeouts and the
# exact torchrun command on stderr.
#
# On SLURM, --slurm takes NNODES, NODE_RANK, RDZV_ID and NPROC_PER_NODE from the job step. It takes
# MASTER_ADDR from the first host of the step's nodes, and MASTER_PORT from the job and step ids. srun
# starts one torchrun per node. The tests run the batch script below. On GPU nodes, add the GPUs to its
# first SBATCH line, for example --gpus-per-node=8.
#
#   #!/bin/bash
#   #SBATCH --nodes=2 --ntasks-per-node=1
#   #SBATCH --signal=USR1@120   # Two minutes before the time limit, every worker checkpoints and stops.
#   #SBATCH --requeue --open-mode=append   # A requeued run appends to the log instead of replacing it.
#   srun ./run_multi_node.sh --slurm -- --out-dir /shared/runs/$SLURM_JOB_ID
#   # The run may be unfinished, because the signal stopped it or a node failed. Then the next line
#   # requeues the job, which continues from the checkpoint in a new allocation.
#   [ -f /shared/runs/$SLURM_JOB_ID/model.pt ] || [ "${SLURM_RESTART_COUNT:-0}" -ge 5 ] || scontrol requeue "$SLURM_JOB_ID"
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  [[ -x "$here/.venv/bin/python" ]] && PYTHON="$here/.venv/bin/python"
fi
die() { echo "run_multi_node.sh: $*" >&2; exit 2; }
# A stop signal goes to torchrun, which passes it to the workers and gives them SHUTDOWN_TIMEOUT. SLURM
# and a terminal send the signal to torchrun themselves. A `kill` of this script alone does not reach
# torchrun. So if torchrun does not say within a second that it got the signal, this script passes it on.
# It passes on no signal that torchrun got, because a second signal would abort torchrun's shutdown. A
# torchrun that is blocked on a node that left the network cannot act on the signal. This script sends
# it SIGKILL SHUTDOWN_TIMEOUT + 15 s later.
# Before torchrun runs, there is nothing to save. Then the script exits 75, or 130 after Ctrl-C, and its
# message says to run it again.
pid='' signalled='' forward_in='' kill_at=''
on_signal() {
  if [[ -z "$pid" ]]; then
    echo "run_multi_node.sh: SIG$1 came before torchrun. There is nothing to save. Run again to start" >&2
    exit "$([[ $1 == INT ]] && echo 130 || echo 75)"
  fi
  # The loop below passes the signal on after 5 turns.
  signalled=$1 forward_in=5 kill_at=$((SECONDS + SHUTDOWN_TIMEOUT + 15))
}
for sig in TERM INT HUP USR1; do trap "on_signal $sig" "$sig"; done

# first_host prints the first host of a SLURM node list, as ddp_train.py's own function does. For
# example, "gpu[07-09,12]-ib,cpu1" gives gpu07-ib.
first_host() {
  # scontrol knows every spelling of a node list, but it needs a configured cluster. Without a cluster,
  # the code below parses the list itself.
  local hosts
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
      [[ -n "${SLURM_JOB_ID:-}" && -n "${SLURM_NODEID:-}" ]] || die "--slurm works only inside a SLURM job step. Run this script with srun"
      # The step's own variables win over the job's, because a step may run on part of the allocation.
      NNODES=${SLURM_STEP_NUM_NODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}
      (( ${SLURM_STEP_NUM_TASKS:-$NNODES} <= NNODES )) ||
        die "--slurm starts one torchrun per node, but this step has $SLURM_STEP_NUM_TASKS tasks on $NNODES node(s). Use srun --ntasks-per-node=1"
      NODE_RANK=$SLURM_NODEID  # It counts within the step, like the step's node list.
      MASTER_ADDR=$(first_host "${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-${SLURM_NODELIST:?}}}"); master_addr_given=yes
      RDZV_ID=${RDZV_ID:-slurm-$SLURM_JOB_ID}
      [[ -n "${SLURM_GPUS_ON_NODE:-}" ]] && NPROC_PER_NODE=${NPROC_PER_NODE:-$SLURM_GPUS_ON_NODE}
      slurm=yes; shift ;;
    --) shift; train_args+=("$@"); break ;;
    *) train_args+=("$1"); shift ;;
  esac
done

# With --slurm, two jobs on one node need two ports, and so do two steps of one job. All nodes of a step
# must agree on the port without talking. The port lies in 61000-65499, above Linux's ephemeral ports,
# which are 32768-60999. So no outgoing connection takes it by chance. ddp_train.py picks a bare srun's
# port by the same rule. The port depends on job id x 11 + step id. So the first steps of 4500 consecutive
# jobs all get different ports, and so do the first 11 steps of neighbouring jobs. This holds because 11
# is prime to 4500. A requeued job keeps its id, so its restart count moves it to another port. The last
# processes of the previous run may still hold the old port for a few seconds.
if [[ -n "$slurm" && -z "${MASTER_PORT:-}" ]]; then
  MASTER_PORT=$(( 61000 + (SLURM_JOB_ID * 11 + ${SLURM_STEP_ID:-0} + 2221 * ${SLURM_RESTART_COUNT:-0}) % 4500 ))
fi
NNODES=${NNODES:-1}
[[ "$NNODES" =~ ^([0-9]+):([0-9]+)$ ]] && elastic=yes || elastic=''
MAX_NODES=${NNODES#*:}  # It is the most nodes, which is NNODES itself or the MAX of MIN:MAX.
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV=${RDZV:-c10d}
RDZV_ID=${RDZV_ID:-ddp_train}
# A TIMEOUT that the user set makes ddp_train.py wait as long in its collectives. Without it,
# ddp_train.py uses its own default of 30 min.
timeout_given=${TIMEOUT:+yes}
TIMEOUT=${TIMEOUT:-300}
MAX_RESTARTS=${MAX_RESTARTS:-$([[ -n "$elastic" ]] && echo 3 || echo 0)}
LAST_CALL=${LAST_CALL:-30}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-120}
SCRIPT=${SCRIPT:-$here/ddp_train.py}
[[ -f "$SCRIPT" ]] || die "--script $SCRIPT is not a file"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')
fi
for v in MAX_NODES NODE_RANK MASTER_PORT NPROC_PER_NODE TIMEOUT MAX_RESTARTS LAST_CALL SHUTDOWN_TIMEOUT; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a whole number, but it is '${!v}'"
done
if [[ -n "$elastic" ]]; then
  (( ${NNODES%:*} >= 1 && ${NNODES%:*} <= MAX_NODES )) || die "NNODES $NNODES is not valid. An elastic NNODES is MIN:MAX with 1 <= MIN <= MAX"
  [[ "$RDZV" == c10d ]] || die "NNODES $NNODES is elastic, so it needs --rdzv c10d"
fi
(( NODE_RANK < MAX_NODES )) || die "NODE_RANK $NODE_RANK is not below NNODES $NNODES"
(( MAX_NODES == 1 )) || [[ -n "$master_addr_given" ]] || die "NNODES is $NNODES, so set MASTER_ADDR to node 0's address. It is the same on every node"
# envs holds what torchrun's environment gets from this script, which prints it with the command.
# A script of your own imports ddp_train. It gets the one beside this file, unless its own directory
# has one.
envs=(PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}")
if [[ -n "${IFNAME:-}" ]]; then
  # IFNAME names the interface that carries traffic between nodes. `ip -brief addr` lists the
  # interfaces. Without IFNAME, gloo and NCCL may pick an interface that other nodes cannot reach, such
  # as docker0 or a VPN. Then they hang at init.
  envs+=(GLOO_SOCKET_IFNAME="$IFNAME" NCCL_SOCKET_IFNAME="$IFNAME")
fi
# A node that joins a running job needs a store of its round. Such a node belongs to an elastic job, or
# its torchrun started again. In torch's shared store, its torchrun waits for the round's address, but
# only the first round's rank 0 writes that address. A fresh store for each round lets any node join.
# The new rank 0 hosts that store.
[[ "$MAX_NODES" -gt 1 && "$RDZV" == c10d ]] && envs+=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}")
# torchrun forwards only the signals that its --signals-to-handle names. PET_SIGNALS_TO_HANDLE sets
# that option, from torch 2.9 on. SLURM's --signal=USR1 is not among the option's defaults. Without this
# setting, USR1 kills torchrun before the workers save. torchrun overwrites TORCHELASTIC_SIGNALS_TO_HANDLE
# with the option's value.
envs+=(PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}")

# These checks run before torchrun, so that the common mistakes get one clear line instead of a hang
# or a traceback. The machine that owns MASTER_ADDR hosts the rendezvous, and its port must be free.
# Every other node waits up to TIMEOUT until it can connect to MASTER_ADDR:MASTER_PORT. Either way, the
# check learns this node's address as the other nodes see it. This script passes that address to
# torchrun, so that torchrun does not rely on hostname lookups.
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
    # This check judges a port as TCPStore does. A port whose last connections linger in TIME_WAIT is
    # free. A run that just ended or a requeued job can leave such connections. A port that something
    # listens on is not free.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((addr, port))
        sys.exit(print("host", addr))  # This machine owns MASTER_ADDR, and the port is free.
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            sys.exit(print(f"port {port} on {host} is already in use. Another job or an earlier run may "
                           "still hold it. Choose another MASTER_PORT"))
deadline = time.monotonic() + timeout
while True:
    try:
        with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))) as c:
            sys.exit(print("client", c.getsockname()[0]))
    except OSError:
        if time.monotonic() >= deadline:
            sys.exit(print(f"cannot reach MASTER_ADDR {host} ({addr}) port {port} within {timeout:g}s. Check "
                           "that node 0 has started, that this is its address as the other nodes see it, "
                           "and that the port is open"))
        time.sleep(0.2)
PY
)
  read -r role local_addr <<<"$verdict"
  case "$role" in
    host) [[ "$RDZV" != static || "$NODE_RANK" == 0 ]] ||
            die "NODE_RANK is $NODE_RANK, but this machine owns MASTER_ADDR $MASTER_ADDR. Node 0 must run here" ;;
    client) [[ "$RDZV" != static || "$NODE_RANK" != 0 ]] ||
            die "NODE_RANK is 0, but MASTER_ADDR $MASTER_ADDR is another machine. Run node 0 on the machine at MASTER_ADDR" ;;
    *) die "$verdict" ;;
  esac
  # gloo advertises the address this machine's hostname resolves to. If that is a loopback address,
  # the other nodes would dial themselves. So IFNAME must name the interface.
  if (( MAX_NODES > 1 )) && [[ -z "${IFNAME:-}${GLOO_SOCKET_IFNAME:-}" ]] &&
     "$PYTHON" -c 'import socket, sys; sys.exit(not socket.gethostbyname(socket.gethostname()).startswith("127."))'; then
    dev=$(ip -o -4 addr show 2>/dev/null | awk -v a="$local_addr" 'index($4, a "/") == 1 {print $2}')
    die "this machine's hostname ($(hostname)) resolves to a loopback address, which other nodes cannot reach: set IFNAME=${dev:-<interface>}, which is the interface with $local_addr"
  fi
fi

launch=(--nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS")
# torchrun has --shutdown-timeout from torch 2.12 on, and --signals-to-handle from torch 2.10 on. An
# older torchrun sends SIGKILL to its workers 30 s after a stop signal, and a SIGUSR1 ends it at once.
# This script says so and goes on.
torchrun_help=$("$PYTHON" -m torch.distributed.run --help 2>/dev/null || true)
if [[ "$torchrun_help" == *--shutdown-timeout* ]]; then
  launch+=(--shutdown-timeout="$SHUTDOWN_TIMEOUT")
else
  SHUTDOWN_TIMEOUT=30
  echo "run_multi_node.sh: this torchrun has no --shutdown-timeout, which came with torch 2.12. After a" \
       "stop signal, the workers get 30 s to save their checkpoint, and then they get SIGKILL. A longer" \
       "save needs torch 2.12 or later$([[ "$torchrun_help" == \
       *--signals-to-handle* ]] || echo ". It also dies of SIGUSR1, which torch 2.10 and later forward. Stop it with SIGTERM")" >&2
fi
[[ -n "$local_addr" ]] && launch+=(--local-addr="$local_addr")
if [[ "$MAX_NODES" == 1 && -z "$master_addr_given" ]]; then
  launch+=(--standalone)  # One node uses a free port, so two runs on one machine never collide.
elif [[ "$RDZV" == c10d ]]; then
  launch+=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID"
           --rdzv-conf="join_timeout=$TIMEOUT,read_timeout=$TIMEOUT,is_host=$([[ $role == host ]] && echo 1 || echo 0)${elastic:+,last_call_timeout=$LAST_CALL}")
elif [[ "$RDZV" == static ]]; then
  launch+=(--node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT"
           --rdzv-conf="timeout=$TIMEOUT")
else
  die "--rdzv must be c10d or static, but it is '$RDZV'"
fi
cmd=("$PYTHON" -m torch.distributed.run "${launch[@]}" "$SCRIPT" ${timeout_given:+--timeout "$TIMEOUT"} "${train_args[@]}")
echo "run_multi_node.sh: $NNODES node(s) run $NPROC_PER_NODE process(es) each. All nodes have ${TIMEOUT}s" \
     "to join. After a stop signal, torchrun gives the workers ${SHUTDOWN_TIMEOUT}s to save, and this" \
     "script sends SIGKILL to torchrun at $((SHUTDOWN_TIMEOUT + 15))s" >&2
line=$(printf '%q ' "${envs[@]}" "${cmd[@]}")
echo "run_multi_node.sh: ${line% }" >&2

# torchrun runs in the background, so that stop signals reach it and, through it, the workers. Then a
# failure also ends with one line that says what it most likely means. SLURM signals every process of
# the step, and the tee too. The tee ignores these signals, so that torchrun's last words still reach
# the log.
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
# This loop lets tee write the last of torchrun's stderr. It waits 2 s at most, because a stray worker
# may hold the pipe open.
for _ in {1..10}; do kill -0 "$tee_pid" 2>/dev/null || break; sleep 0.2; done
if (( code != 0 )) && [[ -z "$signalled" ]]; then
  if grep -q "death signal" "$errlog"; then
    why="torchrun was stopped by a signal. Rerun the same command to continue from the last checkpoint"
  elif grep -q "RendezvousTimeoutError" "$errlog"; then
    why="not all $NNODES nodes joined within ${TIMEOUT}s. Start the same command on every node, with the same NNODES, MASTER_ADDR, MASTER_PORT and RDZV_ID"
  elif grep -qE "RendezvousConnectionError|DistNetworkError|trying to connect to" "$errlog" && ! grep -q "ddp_train.py: " "$errlog"; then
    why="torchrun could not connect to the rendezvous at $MASTER_ADDR:$MASTER_PORT. The lines above show the error"
  elif grep -qE "lost contact with|Connection closed by peer|Connection reset by peer|Timed out waiting" "$errlog"; then
    why="a worker on another node stopped. It crashed, was killed, or left the network. Rerun the same command on every node to resume from the last checkpoint"
  else
    why="torchrun exited with code $code. The first error above is the cause"
  fi
  echo "run_multi_node.sh: $why" >&2
fi
exit "$code"
