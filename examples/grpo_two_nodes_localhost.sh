#!/usr/bin/env bash
# GRPO's tiny preset as two nodes on this machine: two launchers on 127.0.0.1, one per node, as `srun` starts them on
# a cluster. The map (printed first) puts 2 inference servers on node 1's two CPU slots, and the trainer, as 2 FSDP2
# processes over gloo, on node 0's, with the actor and the rendezvous. The samples go through a Redis stream, which
# this script starts unless STREAM names one. The last line sums the run up.
#
#   bash examples/grpo_two_nodes_localhost.sh [OUTPUT_DIR [LAUNCHER FLAGS...]]
#   STREAM=redis://127.0.0.1:6379/0?stream=grpo bash examples/grpo_two_nodes_localhost.sh runs/two-nodes --resume
#
# Node 1's output goes to OUTPUT_DIR/logs/node-1.log, node 0's to the terminal.
set -euo pipefail

out=${1:-runs/grpo-two-nodes}
shift || true
python=${PYTHON:-python}
free_port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

redis_pid="" node1_pid=""
cleanup() {
    # a launcher given SIGTERM stops every process it started
    [[ -n $node1_pid ]] && kill "$node1_pid" 2>/dev/null && wait "$node1_pid" 2>/dev/null
    [[ -n $redis_pid ]] && kill "$redis_pid" 2>/dev/null && wait "$redis_pid" 2>/dev/null
    return 0
}
trap cleanup EXIT

stream=${STREAM:-}
if [[ -z $stream ]]; then
    redis_port=$(free_port)
    redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no >/dev/null &
    redis_pid=$!
    stream="redis://127.0.0.1:$redis_port/0?stream=grpo"
fi

nodes=(--nnodes 2 --master-addr 127.0.0.1 --master-port "$(free_port)" --device cpu --gpus-per-node 2)
flags=(--task tiny --inference-gpus 2 --stream "$stream" --output-dir "$out" "$@")
mkdir -p "$out/logs"
"$python" -m lm_human_preference_details.grpo.launch "${nodes[@]}" --node-rank 1 "${flags[@]}" \
    >>"$out/logs/node-1.log" 2>&1 &
node1_pid=$!
"$python" -m lm_human_preference_details.grpo.launch "${nodes[@]}" --node-rank 0 "${flags[@]}"
wait "$node1_pid"
node1_pid=""
