#!/usr/bin/env bash
# Start the Ray head node of an mcore_rl cluster.
#
# Usage: scripts/ray_head.sh (--node-ip-address IP | --ifname IFACE) [options] [-- RAY_START_ARGS...]
#
#   --node-ip-address IP       address this node is reached at by the other nodes (required,
#                              or --ifname); never 0.0.0.0
#   --ifname IFACE             take the address from this interface (e.g. bond0, ib0)
#   --port PORT                GCS port (default 6379)
#   --dashboard-host HOST      dashboard / job server bind address (default 127.0.0.1)
#   --dashboard-all-interfaces bind the dashboard to 0.0.0.0 (anyone who can reach the port
#                              and holds the token can run code: firewall it)
#   --dashboard-port PORT      (default 8265)
#   --num-cpus N / --num-gpus N   resources announced by this node (default: detected)
#   --temp-dir DIR             Ray temp/session dir (default /tmp/ray); keep it short
#   --token-file PATH          Ray auth token file (created if missing); default
#                              $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token
#   --block                    stay in the foreground (Slurm, dstack, tests); stop with SIGTERM
#   --dry-run                  print the ray command instead of running it
#
# Token authentication is always on (RAY_AUTH_MODE=token): clients and workers need the same token.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }

ray_start_defaults
port="${RAY_HEAD_PORT:-6379}"
dash_host=127.0.0.1
dash_all=0
dash_port="${RAY_DASHBOARD_PORT:-8265}"

while [[ $# -gt 0 ]]; do
    case "$1" in
        --port) need_arg "$1" $#; port="$2"; shift 2 ;;
        --dashboard-host) need_arg "$1" $#; dash_host="$2"; shift 2 ;;
        --dashboard-all-interfaces) dash_all=1; shift ;;
        --dashboard-port) need_arg "$1" $#; dash_port="$2"; shift 2 ;;
        *) ray_start_opt "$@"; shift "$RAY_OPT_SHIFT" ;;
    esac
done

if [[ -n "$ifname" ]]; then
    [[ -z "$node_ip" ]] || die "give --node-ip-address or --ifname, not both"
    node_ip="$(ip_of_ifname "$ifname")"
fi
[[ -n "$node_ip" ]] || die "--node-ip-address IP (or --ifname IFACE) is required: Ray must not guess the NIC"
check_bind_address "$node_ip" "--node-ip-address"

if [[ "$dash_all" == 1 ]]; then
    dash_host=0.0.0.0
    log "warning: dashboard/job server bound to ALL interfaces (0.0.0.0:$dash_port); firewall it"
else
    case "$dash_host" in
        0.0.0.0 | "::" | "[::]") die "--dashboard-host $dash_host exposes the job server on every interface; pass --dashboard-all-interfaces if you really mean it" ;;
        "") die "--dashboard-host must not be empty" ;;
    esac
fi

ray_auth_setup create

cmd=("$RAY_BIN" start --head
    --node-ip-address="$node_ip"
    --port="$port"
    --include-dashboard=true
    --dashboard-host="$dash_host"
    --dashboard-port="$dash_port"
    --disable-usage-stats)
finish_ray_start_cmd

log "head: GCS ${node_ip}:${port}, dashboard/job server http://${dash_host}:${dash_port}, token ${RAY_AUTH_TOKEN_PATH:-from RAY_AUTH_TOKEN}"
log "workers: scripts/ray_worker.sh --head-address ${node_ip}:${port} --node-ip-address <their IP> --token-file <copy of the token>"
export RAY_USAGE_STATS_ENABLED=0
exec "${cmd[@]}"
