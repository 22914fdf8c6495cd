#!/usr/bin/env bash
# A local three-master Redis Cluster for the tests, from the redis-server binary.
#   .ci/redis_cluster.sh start DIR [FIRST_PORT]   start nodes on FIRST_PORT.. FIRST_PORT+2 (default 7101),
#                                                 join them, wait for cluster_state:ok
#   .ci/redis_cluster.sh stop DIR                 stop the nodes started in DIR and remove DIR
# Each node also uses its port + 10000 (the cluster bus). Nothing is persisted.
set -euo pipefail

command="${1:?usage: redis_cluster.sh start|stop DIR [FIRST_PORT]}"
dir="${2:?usage: redis_cluster.sh start|stop DIR [FIRST_PORT]}"
first_port="${3:-7101}"
ports=("$first_port" "$((first_port + 1))" "$((first_port + 2))")

stop() {
    pids=()
    for pidfile in "$dir"/node*/redis.pid; do
        [ -f "$pidfile" ] && pids+=("$(cat "$pidfile")")
    done
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    done
    rm -rf "$dir"
}

start() {
    mkdir -p "$dir"
    for port in "${ports[@]}"; do
        node="$dir/node$port"
        mkdir -p "$node"
        redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
            --cluster-enabled yes --cluster-config-file nodes.conf --dir "$node" \
            --pidfile "$node/redis.pid" --logfile "$node/redis.log"
    done
    for port in "${ports[@]}"; do
        for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
    done
    addresses=()
    for port in "${ports[@]}"; do addresses+=("127.0.0.1:$port"); done
    redis-cli --cluster create "${addresses[@]}" --cluster-replicas 0 --cluster-yes >"$dir/create.log"
    for port in "${ports[@]}"; do
        for _ in $(seq 150); do
            redis-cli -p "$port" cluster info | grep -q '^cluster_state:ok' && continue 2
            sleep 0.1
        done
        echo "redis_cluster.sh: node $port did not reach cluster_state:ok" >&2
        exit 1
    done
}

case "$command" in
    start) start ;;
    stop) stop ;;
    *) echo "redis_cluster.sh: unknown command $command (start|stop)" >&2; exit 2 ;;
esac
