# A cluster of hosts on this machine, for tests: each host a Linux network namespace with its own
# loopback, interface e0 and address in 198.18.N.0/24 (the benchmarking range, RFC 2544, and no
# other network), joined by veth pairs to a bridge in a namespace of its own (the machine's own
# network is never touched), and its own hostname (a UTS namespace per command), so Open MPI sees
# distinct nodes. Source it from bash, as root:
#   cluster_up 4              hosts h1..h4; HOST_ADDR[1..4], HOST_NS[1..4]; an EXIT trap removes all
#   on 2 CMD ARGS...          runs CMD on host 2
#   cluster_kill 3            SIGKILLs every process of host 3 (a host lost)
#   cluster_host_down 3       the launcher cannot reach host 3 until cluster_host_back 3
#   cluster_down              kills every process of every host, deletes the namespaces (and so the links)
# mpirun reaches the hosts through tests/cluster/netns-rsh (OMPI_MCA_plm_rsh_agent, exported here),
# which reads the address -> namespace map from $CLUSTER_DIR/hosts.
CLUSTER_TAG="pdc$$"
CLUSTER_NET="198.18.$(( $$ % 250 + 1 ))"
CLUSTER_DIR=$(mktemp -d /tmp/pdmoe-cluster-XXXXXX)
HOST_ADDR=()
HOST_NS=()
CLUSTER_N=0

cluster_down() {
    local i
    for ((i = 1; i <= CLUSTER_N; i++)); do
        ip netns pids "${HOST_NS[$i]}" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    done
    for ((i = 1; i <= CLUSTER_N; i++)); do
        # a process that was exiting may still hold the namespace for a moment
        local t
        for t in 1 2 3 4 5; do
            [ -z "$(ip netns pids "${HOST_NS[$i]}" 2>/dev/null)" ] && break
            sleep 0.2
        done
        ip netns del "${HOST_NS[$i]}" 2>/dev/null || true
    done
    ip netns del "$CLUSTER_TAG-br" 2>/dev/null || true
    rm -rf "$CLUSTER_DIR"
    CLUSTER_N=0
}

cluster_up() {
    local n=$1 i ns
    trap cluster_down EXIT
    ip netns add "$CLUSTER_TAG-br"
    ip -n "$CLUSTER_TAG-br" link set lo up
    ip -n "$CLUSTER_TAG-br" link add br0 type bridge
    ip -n "$CLUSTER_TAG-br" link set br0 up
    : > "$CLUSTER_DIR/hosts"
    for ((i = 1; i <= n; i++)); do
        ns="$CLUSTER_TAG-h$i"
        HOST_NS[$i]=$ns
        HOST_ADDR[$i]="$CLUSTER_NET.$i"
        CLUSTER_N=$i
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip link add "${CLUSTER_TAG}v$i" type veth peer name e0 netns "$ns"
        ip link set "${CLUSTER_TAG}v$i" netns "$CLUSTER_TAG-br"
        ip -n "$CLUSTER_TAG-br" link set "${CLUSTER_TAG}v$i" master br0 up
        ip -n "$ns" addr add "${HOST_ADDR[$i]}/24" dev e0
        ip -n "$ns" link set e0 up
        echo "${HOST_ADDR[$i]} $ns h$i" >> "$CLUSTER_DIR/hosts"
    done
    export PDMOE_CLUSTER_HOSTS="$CLUSTER_DIR/hosts"
    export OMPI_MCA_plm_rsh_agent="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/netns-rsh"
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
}

# on I CMD...: CMD on host I, with that host's hostname
on() {
    local i=$1
    shift
    ip netns exec "${HOST_NS[$i]}" unshare --uts sh -c 'hostname "$0"; exec "$@"' "h$i" "$@"
}

# on_exec I CMD...: the same, replacing this shell, so `( on_exec 1 pdmoe up ... ) &` makes $! the
# pid of CMD itself (a signal to $! reaches it)
on_exec() {
    local i=$1
    shift
    exec ip netns exec "${HOST_NS[$i]}" unshare --uts sh -c 'hostname "$0"; exec "$@"' "h$i" "$@"
}

cluster_kill() {
    ip netns pids "${HOST_NS[$1]}" | xargs -r kill -9 2>/dev/null || true
}

# cluster_host_down I / cluster_host_back I: while down, the launcher cannot reach host I
cluster_host_down() {
    touch "$CLUSTER_DIR/hosts.down-${HOST_ADDR[$1]}"
}
cluster_host_back() {
    rm -f "$CLUSTER_DIR/hosts.down-${HOST_ADDR[$1]}"
}

# the veth of host I, as the bridge namespace sees it (for tc)
cluster_link() {
    echo "$CLUSTER_TAG-br ${CLUSTER_TAG}v$1"
}

# The namespace hosts share one kernel, /dev/shm and boot id, so UCX would take them for one machine
# and choose its shared-memory transports between them, which real hosts never have (and whose
# wire-up stalls across network namespaces). Between hosts without RDMA, UCX uses TCP: so here.
export UCX_TLS=tcp
