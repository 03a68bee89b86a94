#!/usr/bin/env bash
# Shortcuts for `ray job ...` against an mcore_rl cluster.
#
# Usage: scripts/jobs.sh [--address URL] [--token-file PATH] COMMAND [ARGS]
#
#   list                          all jobs
#   status JOB_ID                 status of one job
#   logs JOB_ID [-f|--follow]     the job's driver log (follow until it ends with -f)
#   stop JOB_ID                   stop a job
#   wait JOB_ID [--timeout S]     block until the job ends; exit 0 only if it SUCCEEDED
#   nodes                         number of alive Ray nodes
#   wait-nodes N [--timeout S]    block until at least N nodes are alive
#
#   --address URL     job server (dashboard) URL; default $RAY_API_SERVER_ADDRESS or
#                     http://127.0.0.1:8265
#   --token-file PATH Ray auth token (default $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }

address="${RAY_API_SERVER_ADDRESS:-http://127.0.0.1:8265}"
args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --address) need_arg "$1" $#; address="$2"; shift 2 ;;
        --token-file) need_arg "$1" $#; export RAY_AUTH_TOKEN_PATH="$2"; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) args+=("$1"); shift ;;
    esac
done
set -- "${args[@]}"
[[ $# -ge 1 ]] || { usage >&2; exit 2; }
command="$1"
shift

ray_auth_setup require
export RAY_API_SERVER_ADDRESS="$address"

job_id() { [[ -n "${1:-}" ]] || die "$command needs a JOB_ID"; printf '%s' "$1"; }

# Print the job's status word (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED) or nothing.
# `ray job status` words terminal states as sentences and the others as "Status for job ...: X".
job_status() {
    "$RAY_BIN" job status --address "$address" --log-style record --log-color false "$1" 2>&1 \
        | sed -n -e "s/.*Job '[^']*' succeeded.*/SUCCEEDED/p" \
            -e "s/.*Job '[^']*' failed.*/FAILED/p" \
            -e "s/.*Job '[^']*' was stopped.*/STOPPED/p" \
            -e "s/.*Status for job '[^']*': \([A-Z]*\).*/\1/p" | tail -n 1
}

alive_nodes() {
    "$RAY_BIN" list nodes --address "$address" --filter "state=ALIVE" --format json --limit 10000 2>/dev/null \
        | "$PYTHON" -c 'import json, sys; print(len(json.load(sys.stdin)))' 2>/dev/null || echo 0
}

timeout_opt() {  # parse "[--timeout S]" from the remaining args, default $1
    local t="$1"
    shift
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --timeout) need_arg "$1" $#; t="$2"; shift 2 ;;
            *) die "unexpected argument '$1'" ;;
        esac
    done
    printf '%s' "$t"
}

case "$command" in
    list) exec "$RAY_BIN" job list --address "$address" ;;
    status) exec "$RAY_BIN" job status --address "$address" "$(job_id "${1:-}")" ;;
    stop) exec "$RAY_BIN" job stop --address "$address" "$(job_id "${1:-}")" ;;
    logs)
        id="$(job_id "${1:-}")"
        case "${2:-}" in
            -f | --follow) exec "$RAY_BIN" job logs --address "$address" --follow "$id" ;;
            "") exec "$RAY_BIN" job logs --address "$address" "$id" ;;
            *) die "logs takes JOB_ID [-f]" ;;
        esac ;;
    wait)
        id="$(job_id "${1:-}")"
        shift
        deadline=$((SECONDS + $(timeout_opt 3600 "$@")))
        while :; do
            status="$(job_status "$id")"
            case "$status" in
                SUCCEEDED) log "job $id SUCCEEDED"; exit 0 ;;
                FAILED | STOPPED) log "job $id $status; see: scripts/jobs.sh logs $id"; exit 1 ;;
            esac
            [[ $SECONDS -lt $deadline ]] || die "job $id still ${status:-unknown} at the timeout"
            sleep 2
        done ;;
    nodes) alive_nodes ;;
    wait-nodes)
        want="${1:-}"
        [[ "$want" =~ ^[0-9]+$ ]] || die "wait-nodes needs a node count"
        shift
        deadline=$((SECONDS + $(timeout_opt 600 "$@")))
        while :; do
            have="$(alive_nodes)"
            if [[ "$have" -ge "$want" ]]; then
                log "$have/$want nodes alive"
                exit 0
            fi
            [[ $SECONDS -lt $deadline ]] || die "only $have/$want nodes alive at the timeout"
            sleep 3
        done ;;
    *) die "unknown command '$command' (see --help)" ;;
esac
