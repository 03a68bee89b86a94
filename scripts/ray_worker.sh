#!/usr/bin/env bash
# Start a Ray worker node and join it to the head.
#
# Usage: scripts/ray_worker.sh --head-address HOST:PORT (--node-ip-address IP | --ifname IFACE)
#                              [options] [-- RAY_START_ARGS...]
#
#   --head-address HOST:PORT   the head's GCS address (default $RAY_HEAD_ADDRESS)
#   --node-ip-address IP       this node's address as the others reach it; never 0.0.0.0.
#                              "route" means: the local address the kernel uses to reach the head
#   --ifname IFACE             take the address from this interface (e.g. bond0, ib0)
#   --num-cpus N / --num-gpus N   resources announced by this node (default: detected)
#   --temp-dir DIR             Ray temp/session dir (default /tmp/ray); keep it short
#   --token-file PATH          copy of the head's auth token (default $RAY_AUTH_TOKEN_PATH or
#                              ~/.ray/auth_token); RAY_AUTH_TOKEN works too
#   --wait-for-head SECONDS    wait up to SECONDS for the head's GCS port to accept connections
#   --block                    stay in the foreground (Slurm, dstack, tests); stop with SIGTERM
#   --dry-run                  print the ray command instead of running it
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }

ray_start_defaults
head_addr="${RAY_HEAD_ADDRESS:-}"
wait_s=0

while [[ $# -gt 0 ]]; do
    case "$1" in
        --head-address | --address) need_arg "$1" $#; head_addr="$2"; shift 2 ;;
        --wait-for-head) need_arg "$1" $#; wait_s="$2"; shift 2 ;;
        *) ray_start_opt "$@"; shift "$RAY_OPT_SHIFT" ;;
    esac
done

[[ -n "$head_addr" ]] || die "--head-address HOST:PORT is required"
[[ "$head_addr" == *:* ]] || die "--head-address must be HOST:PORT, got '$head_addr'"
head_host="${head_addr%:*}"
head_port="${head_addr##*:}"

if [[ -n "$ifname" ]]; then
    [[ -z "$node_ip" ]] || die "give --node-ip-address or --ifname, not both"
    node_ip="$(ip_of_ifname "$ifname")"
elif [[ "$node_ip" == route ]]; then
    node_ip="$(bash "$MCORE_RL_SCRIPTS_DIR/node_ip.sh" --route-to "$head_host")"
fi
[[ -n "$node_ip" ]] || die "--node-ip-address IP (or --ifname IFACE, or 'route') is required: Ray must not guess the NIC"
check_bind_address "$node_ip" "--node-ip-address"

ray_auth_setup require

cmd=("$RAY_BIN" start
    --address="$head_addr"
    --node-ip-address="$node_ip"
    --disable-usage-stats)
finish_ray_start_cmd

if [[ "$wait_s" -gt 0 ]]; then
    deadline=$((SECONDS + wait_s))
    until (exec 3<>"/dev/tcp/${head_host}/${head_port}") 2>/dev/null; do
        [[ $SECONDS -lt $deadline ]] || die "head ${head_addr} not reachable after ${wait_s}s"
        sleep 2
    done
fi

log "worker ${node_ip} joining head ${head_addr}"
export RAY_USAGE_STATS_ENABLED=0
exec "${cmd[@]}"
