#!/usr/bin/env bash
# Two Ray nodes on one machine, and `ckptd demo` across both of them.
#
#   deploy/local/two_nodes.sh shared      [demo options]   # one root both nodes see: passes
#   deploy/local/two_nodes.sh node-local  [demo options]   # each node its own disk: refused
#
# The head node and a worker node are two `ray start` processes, each with its own temp
# directory, ports and session. The worker node runs in its own mount namespace (an
# unprivileged user namespace: `unshare --user --map-root-user --mount`), where a directory is
# bind-mounted over the path that stands for the cluster's shared filesystem:
#   shared      the same directory: both nodes see one filesystem (as with NFS).
#   node-local  a directory of its own: the same path is another disk on each node, as a local
#               path is on a real cluster. ckptd's shared-root check must refuse the run.
# The demo (its driver runs on the head node) trains on ranks spread over both nodes, saves
# through ckptd with a mirror, resumes on 3 ranks and exports to HF.
#
# Environment: PYTHON (default: python3) must import ckptd and ray; CKPTD_TWO_NODES_DIR, where
# the nodes' temp directories and disks go (default: a new directory under /tmp; kept if set,
# removed otherwise). Both nodes are stopped on exit, whatever happens: only the processes
# started here are signalled (by process group), never another Ray instance on this machine.
set -euo pipefail

mode=${1:-}
case "$mode" in
  shared|node-local) shift ;;
  *) echo "usage: $0 shared|node-local [ckptd demo options]" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
if ! unshare --user --map-root-user --mount true 2>/dev/null; then
  echo "two_nodes.sh: this kernel does not allow unprivileged user and mount namespaces" \
       "(unshare --user --map-root-user --mount); the worker node cannot get a disk of its own" >&2
  exit 3
fi

# Short paths: Ray's Unix sockets live under the temp directories (at most 107 bytes).
work=${CKPTD_TWO_NODES_DIR:-$(mktemp -d /tmp/ckptd-2n.XXXXXX)}
mkdir -p "$work"
work=$(cd "$work" && pwd)
mnt="$work/mnt"                  # the "shared filesystem": this path, the same on both nodes
worker_disk="$work/worker-disk"  # node-local mode: what the worker node sees at $mnt instead
mkdir -p "$mnt" "$worker_disk" "$work/h" "$work/w"
if [ "$mode" = shared ]; then worker_src=$mnt; else worker_src=$worker_disk; fi
root=$mnt/ckpt
mirror=$mnt/mirror

pids=()
running() {  # is any process of these process groups still running (zombies do not count)?
  local groups=" $* "
  ps -e -o pgid=,stat= | awk -v groups="$groups" \
    'index(groups, " " $1 " ") && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}
cleanup() {
  local rc=$?
  # SIGTERM to each node's process group: `ray start --block` stops its node's processes
  # (raylet, GCS, workers) on SIGTERM; whatever is left after the grace period gets SIGKILL.
  local started=$SECONDS
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for _ in $(seq 150); do
    running "${pids[@]}" || break
    sleep 0.2
  done
  if running "${pids[@]}"; then
    echo "two_nodes.sh: the nodes did not stop within 30 s of SIGTERM; killing them" >&2
    for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  fi
  [ ${#pids[@]} = 0 ] || echo "two_nodes.sh: stopped the Ray nodes in $((SECONDS - started)) s" >&2
  if [ -z "${CKPTD_TWO_NODES_DIR:-}" ]; then rm -rf "$work"; fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Free TCP ports for one node, picked anew at each start. Below the kernel's ephemeral range,
# where no outgoing connection's local end lands (one that takes a port picked from that range
# before the node binds it kills its raylet at start-up, and again if it is started on the same
# ports), and above Ray's worker ports (10002-19999).
pick_ports() {
  "$PYTHON" - "$1" <<'PY'
import random, socket, sys
n = int(sys.argv[1])
try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
except (OSError, ValueError, IndexError):
    low = 32768
candidates = list(range(20000, low))
random.shuffle(candidates)
socks = []
for port in candidates:
    if len(socks) == n:
        break
    s = socket.socket()
    try:
        s.bind(("", port))
    except OSError:
        s.close()
        continue
    socks.append(s)
while len(socks) < n:  # no room below the ephemeral range: any free port
    s = socket.socket()
    s.bind(("", 0))
    socks.append(s)
print(*[s.getsockname()[1] for s in socks])
PY
}
common=(--block --num-cpus 1 --object-store-memory 100000000 --disable-usage-stats)
# Token authentication, with a token of this cluster's own: every node and the driver read it
# from the file named here (a worker node does not turn it on by itself).
"$PYTHON" -c 'import secrets; print(secrets.token_hex(32), end="")' >"$work/auth_token"
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$work/auth_token"
# On SIGTERM a node first drains for up to 30 s, for services that finish requests; none here.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0

# A starting raylet waits at most 15 s (fixed in Ray, ray-project/ray#65983) for its dashboard
# agent to write its port files, and exits if it has not; on a machine whose cores other work
# keeps busy, the agent's start (a few seconds of CPU) can take longer. CKPTD_TWO_NODES_START_NICE
# (a negative niceness, e.g. -10; raising priority needs root or CAP_SYS_NICE) starts each node
# at that priority, and its processes go back to niceness 0 once the node is up, so the nodes do
# not take the machine for the whole run. Unset: the nodes start as everything else does.
start_nice=${CKPTD_TWO_NODES_START_NICE:-}
prio=()
if [ -n "$start_nice" ]; then prio=(nice -n "$start_nice"); fi
normal_priority() {  # the last node started: its process group back to niceness 0
  if [ -n "$start_nice" ]; then renice -n 0 -g "${pids[-1]}" >/dev/null 2>&1 || true; fi
}

# setsid: each node leads its own process group, which cleanup signals as a whole.
start_head_node() {
  read -r gcs client agent agent_grpc metrics runtime_env nm1 om1 < <(pick_ports 8)
  setsid ${prio[@]+"${prio[@]}"} "$PYTHON" -m ray.scripts.scripts start --head "${common[@]}" --temp-dir "$work/h" --port "$gcs" \
    --include-dashboard false --ray-client-server-port "$client" --dashboard-agent-listen-port "$agent" \
    --dashboard-agent-grpc-port "$agent_grpc" --metrics-export-port "$metrics" \
    --runtime-env-agent-port "$runtime_env" --node-manager-port "$nm1" --object-manager-port "$om1" \
    >"$work/head.log" 2>&1 &
  pids+=($!)
  disown  # no job notices; cleanup() waits for the process groups itself
}

# The head node is up once it has written its address (120 s at most). Exit 0 once it has, 3 if
# its `ray start` ended first.
wait_for_head_node() {
  for _ in $(seq 600); do
    [ -s "$work/h/ray_current_cluster" ] && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || return 3
    sleep 0.2
  done
  echo "two_nodes.sh: the head node did not write its address within 120 s" >&2
  return 1
}

# Ray gives a starting node 30 s to register with the GCS and then gives up, and a raylet dies
# at start-up when one of its ports is taken or its agents are slow to start; on a loaded
# machine that happens, to the worker node and to the head node's own raylet alike. So a node
# whose `ray start` gave up before the node was up is started again (twice at most), on new
# ports. bring_up head|worker returns 0 once the node is up, 3 if its `ray start` gave up three
# times, 1 on any other failure.
bring_up() {
  local node=$1 rc attempt
  "start_${node}_node"
  for attempt in 1 2 3; do
    rc=0
    "wait_for_${node}_node" || rc=$?
    if [ "$rc" = 0 ]; then normal_priority; fi
    if [ "$rc" != 3 ] || [ "$attempt" = 3 ]; then return "$rc"; fi
    echo "two_nodes.sh: the $node node stopped before it was up; starting it again" >&2
    tail -n 3 "$work/$node.log" >&2
    raylet_errors "$node"
    kill -KILL -- "-${pids[-1]}" 2>/dev/null || true  # whatever its failed start left running
    mv "$work/$node.log" "$work/$node.$attempt.log"
    "start_${node}_node"
  done
}

# Why a node's last start failed, in its processes' own words (`ray start` does not say): the
# fatal lines of its raylet, and the last lines of its dashboard agent's log (a raylet that timed
# out waiting for the agent's port file names that file). Every start of a node writes into the
# same session's logs: the lines shown are the last ones there.
raylet_errors() {
  local logs dir=$work/${1:0:1}
  logs=$(ls -td "$dir"/session_*/logs 2>/dev/null | head -n 1)
  [ -n "$logs" ] || return 0
  grep -h -A1 -e "Check failed" -e "unexpected system state" -e "exited immediately" \
    "$logs"/raylet*.out 2>/dev/null | cut -c1-400 | tail -n 4 >&2 || true
  tail -n 4 "$logs"/dashboard_agent*.log 2>/dev/null | cut -c1-300 >&2 || true
}

rc=0
bring_up head || rc=$?
if [ "$rc" != 0 ]; then
  cat "$work/head.log" >&2
  raylet_errors head
  echo "two_nodes.sh: the head node did not start" >&2
  exit 1
fi
address=$(cat "$work/h/ray_current_cluster")  # host:port of the head node's GCS

# The worker node: its own mount namespace, where $worker_src is mounted at $mnt.
start_worker_node() {
  read -r nm2 om2 agent2 agent_grpc2 metrics2 runtime_env2 < <(pick_ports 6)
  setsid ${prio[@]+"${prio[@]}"} unshare --user --map-root-user --mount -- sh -c 'mount --bind "$1" "$2" && shift 2 && exec "$@"' \
    sh "$worker_src" "$mnt" \
    "$PYTHON" -m ray.scripts.scripts start "${common[@]}" --address "$address" --temp-dir "$work/w" \
    --dashboard-agent-listen-port "$agent2" --dashboard-agent-grpc-port "$agent_grpc2" \
    --metrics-export-port "$metrics2" --runtime-env-agent-port "$runtime_env2" \
    --node-manager-port "$nm2" --object-manager-port "$om2" >"$work/worker.log" 2>&1 &
  pids+=($!)
  disown
}

# Wait for both nodes to be alive in the cluster: exit 0 once they are, 3 if the worker node's
# `ray start` ended first (setsid, unshare and sh exec it, so it is the last pid started).
wait_for_worker_node() {
  RAY_ADDRESS=$address WORKER_PID=${pids[-1]} "$PYTHON" - <<'PY'
import logging, os, sys, time
import ray


def ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


ray.init(logging_level=logging.ERROR, log_to_driver=False)
deadline = time.monotonic() + 120
while len([n for n in ray.nodes() if n["Alive"]]) < 2:
    if ended(int(os.environ["WORKER_PID"])):
        sys.exit(3)
    if time.monotonic() > deadline:
        sys.exit("two_nodes.sh: the worker node did not join the cluster within 120 s")
    time.sleep(0.2)
PY
}

rc=0
bring_up worker || rc=$?
if [ "$rc" != 0 ]; then
  [ "$rc" = 3 ] && echo "two_nodes.sh: the worker node stopped before it joined the cluster" >&2
  tail -n 30 "$work/head.log" "$work/worker.log" >&2
  raylet_errors worker
  exit 1
fi
echo "two Ray nodes up at $address (temp dirs $work/h and $work/w); mode $mode: the worker node sees" \
     "$([ "$mode" = shared ] && echo "the same directory" || echo "its own disk") at $mnt"

# The driver runs on the head node. Its exit status is this script's.
"$PYTHON" -m ckptd demo --address "$address" --root "$root" --mirror "$mirror" "$@"
