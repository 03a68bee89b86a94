# shellcheck shell=bash
# Helpers shared by the mcore_rl cluster scripts (sourced, never executed).

MCORE_RL_SCRIPTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MCORE_RL_REPO_DIR="$(cd "$MCORE_RL_SCRIPTS_DIR/.." && pwd)"
RAY_BIN="${RAY_BIN:-ray}"
PYTHON="${PYTHON:-python3}"
export MCORE_RL_SCRIPTS_DIR MCORE_RL_REPO_DIR

log() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
die() { log "error: $*"; exit 2; }

# need_arg OPTION "$#": die unless OPTION has a value after it.
need_arg() { [[ "$2" -ge 2 ]] || die "$1 needs a value"; }

# Turn Ray token authentication on for this process and its children.
#   ray_auth_setup create   generate a token file if none exists (head node)
#   ray_auth_setup require  fail if no token can be found (workers, clients)
# The token comes from RAY_AUTH_TOKEN, else RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token.
ray_auth_setup() {
    export RAY_AUTH_MODE=token
    if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
        return 0
    fi
    local file="${RAY_AUTH_TOKEN_PATH:-${HOME}/.ray/auth_token}"
    if [[ ! -s "$file" ]]; then
        if [[ "$1" == create ]]; then
            mkdir -p "$(dirname "$file")"
            (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$file")
            log "generated a new Ray auth token in $file; give the same file to every node and client"
        else
            die "Ray token auth is on but no token was found: copy the head's token file here and pass --token-file PATH (or set RAY_AUTH_TOKEN_PATH / RAY_AUTH_TOKEN)"
        fi
    fi
    local mode
    mode="$(stat -c '%a' "$file" 2>/dev/null || echo 600)"
    if [[ "${mode: -2}" != "00" ]]; then
        log "warning: $file is readable by other users (mode $mode); run: chmod 600 $file"
    fi
    export RAY_AUTH_TOKEN_PATH="$file"
}

# This node's IPv4 address for an interface name (scripts/node_ip.sh does the work).
ip_of_ifname() { bash "$MCORE_RL_SCRIPTS_DIR/node_ip.sh" --ifname "$1"; }

# Refuse addresses that would make a Ray component listen on every interface.
check_bind_address() {
    case "$1" in
        "" | 0.0.0.0 | "::" | "[::]") die "$2 must be a concrete address, got '${1}'" ;;
    esac
}

# The option variables both ray_*.sh scripts share, before their own defaults.
ray_start_defaults() {
    node_ip="${MCORE_RL_NODE_IP:-}"
    ifname=""
    num_cpus=""
    num_gpus=""
    temp_dir=""
    block=0
    dry_run=0
    extra=()
}

# ray_start_opt "$@": take one option both ray_*.sh scripts share (their --help texts say what each
# means) into the caller's variables; RAY_OPT_SHIFT says how many arguments it used.
# shellcheck disable=SC2034  # the variables belong to the calling script
ray_start_opt() {
    RAY_OPT_SHIFT=2
    case "$1" in
        --node-ip-address) need_arg "$1" $#; node_ip="$2" ;;
        --ifname) need_arg "$1" $#; ifname="$2" ;;
        --num-cpus) need_arg "$1" $#; num_cpus="$2" ;;
        --num-gpus) need_arg "$1" $#; num_gpus="$2" ;;
        --temp-dir) need_arg "$1" $#; temp_dir="$2" ;;
        --token-file) need_arg "$1" $#; export RAY_AUTH_TOKEN_PATH="$2" ;;
        --block) block=1; RAY_OPT_SHIFT=1 ;;
        --dry-run) dry_run=1; RAY_OPT_SHIFT=1 ;;
        -h | --help) usage; exit 0 ;;
        --) extra=("${@:2}"); RAY_OPT_SHIFT=$# ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
}

# Options `ray start` takes the same way on head and workers; the caller's array `cmd` grows.
# On --dry-run, print the command and exit.
# shellcheck disable=SC2154  # the option variables belong to the calling script
finish_ray_start_cmd() {
    [[ -n "$num_cpus" ]] && cmd+=(--num-cpus="$num_cpus")
    [[ -n "$num_gpus" ]] && cmd+=(--num-gpus="$num_gpus")
    [[ -n "$temp_dir" ]] && cmd+=(--temp-dir="$temp_dir")
    [[ "$block" == 1 ]] && cmd+=(--block)
    cmd+=("${extra[@]}")
    if [[ "$dry_run" == 1 ]]; then
        printf '%q ' "${cmd[@]}"
        echo
        exit 0
    fi
}
