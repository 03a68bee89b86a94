#!/usr/bin/env bash
# Submit an mcore_rl job to a running Ray cluster with `ray job submit`.
#
# Usage: scripts/submit.sh [options] [KEY=VALUE ...] [-- ENTRYPOINT...]
#
# Without "-- ENTRYPOINT" the job runs the trainer:
#     python -m mcore_rl.train --config configs/<config>.yaml [KEY=VALUE ...]
#
#   --config NAME|PATH     trainer config: configs/NAME.yaml, or a path (default $MCORE_RL_CONFIG)
#   --preset NAME|FILE     source scripts/presets/NAME.env first (h20, h800) or a given env file
#   --address URL          job server (dashboard) URL; default $RAY_API_SERVER_ADDRESS or
#                          http://127.0.0.1:8265 (the head binds it to loopback: run this on the
#                          head node or through an SSH tunnel)
#   --token-file PATH      Ray auth token (default $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)
#   --working-dir DIR      uploaded as the job's working_dir (default: the repository root)
#   --exclude PATTERN      extra gitignore-style upload exclude (repeatable)
#   --env KEY=VALUE        extra environment variable for the job (repeatable)
#   --submission-id ID     job id (default: ray picks one)
#   --debug                RAY_DEBUG=1 (+ post-mortem) in the job: attach Ray's distributed debugger
#   --no-wait              return after submission instead of following the logs
#   --dry-run              print the runtime_env JSON and the command, submit nothing
#
# Environment variables passed through to the job when set: GLOO_SOCKET_IFNAME,
# NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_GID_INDEX, TORCH_NCCL_AVOID_RECORD_STREAMS,
# NUMEXPR_MAX_THREADS, HF_HOME and the others in PASS_ENV below, plus any names listed in
# $MCORE_RL_PASS_ENV (space separated).
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

usage() { sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; }

PASS_ENV=(GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME NCCL_IB_HCA NCCL_IB_GID_INDEX
    TORCH_NCCL_AVOID_RECORD_STREAMS NUMEXPR_MAX_THREADS HF_HOME
    NCCL_DEBUG NCCL_IB_DISABLE NCCL_NVLS_ENABLE NCCL_IB_TC NCCL_IB_SL NCCL_IB_QPS_PER_CONNECTION
    NCCL_NET_GDR_LEVEL NCCL_CROSS_NIC NCCL_P2P_LEVEL NCCL_TIMEOUT
    CUDA_DEVICE_MAX_CONNECTIONS PYTORCH_CUDA_ALLOC_CONF MKL_THREADING_LAYER MKL_SERVICE_FORCE_INTEL
    HF_HUB_OFFLINE HF_DATASETS_OFFLINE TRANSFORMERS_OFFLINE RAY_DEBUG RAY_DEBUG_POST_MORTEM)
EXCLUDES=(.git .venv venv runs outputs build dist .pytest_cache .ruff_cache .mypy_cache __pycache__ "*.egg-info"
    .whl .gl .sglang-gpu .gpu-extra checkpoints wandb "*.pyc")  # the GPU staging dirs: hundreds of MB

config="${MCORE_RL_CONFIG:-}"
address="${RAY_API_SERVER_ADDRESS:-http://127.0.0.1:8265}"
working_dir="$MCORE_RL_REPO_DIR"
submission_id=""
no_wait=0
dry_run=0
overrides=()
entrypoint=()
extra_env=()

while [[ $# -gt 0 ]]; do
    case "$1" in
        --config) need_arg "$1" $#; config="$2"; shift 2 ;;
        --preset)
            need_arg "$1" $#
            preset="$2"
            [[ -f "$preset" ]] || preset="$MCORE_RL_SCRIPTS_DIR/presets/$2.env"
            if [[ ! -f "$preset" ]]; then
                known=("$MCORE_RL_SCRIPTS_DIR"/presets/*.env)
                known=("${known[@]##*/}")
                die "no preset '$2' (have: ${known[*]%.env})"
            fi
            # shellcheck source=/dev/null
            source "$preset"
            shift 2 ;;
        --address) need_arg "$1" $#; address="$2"; shift 2 ;;
        --token-file) need_arg "$1" $#; export RAY_AUTH_TOKEN_PATH="$2"; shift 2 ;;
        --working-dir) need_arg "$1" $#; working_dir="$2"; shift 2 ;;
        --exclude) need_arg "$1" $#; EXCLUDES+=("$2"); shift 2 ;;
        --env)
            need_arg "$1" $#
            [[ "$2" == *=* && "${2%%=*}" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "--env needs KEY=VALUE, got '$2'"
            export "${2?}"
            extra_env+=("${2%%=*}")
            shift 2 ;;
        --submission-id) need_arg "$1" $#; submission_id="$2"; shift 2 ;;
        --debug) export RAY_DEBUG=1 RAY_DEBUG_POST_MORTEM=1; shift ;;
        --no-wait) no_wait=1; shift ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; entrypoint=("$@"); break ;;
        -*) die "unknown option '$1' (see --help)" ;;
        *=*) overrides+=("$1"); shift ;;
        *) die "unexpected argument '$1': trainer overrides are KEY=VALUE, a custom entrypoint goes after --" ;;
    esac
done

if [[ ${#entrypoint[@]} -eq 0 ]]; then
    [[ -n "$config" ]] || die "--config NAME is required for the default entrypoint (python -m mcore_rl.train); or give -- ENTRYPOINT..."
    case "$config" in
        */* | *.yaml | *.yml) config_path="$config" ;;
        *) config_path="configs/${config}.yaml" ;;
    esac
    [[ -f "$working_dir/$config_path" || -f "$config_path" ]] || log "warning: $config_path not found under $working_dir"
    entrypoint=(python -m mcore_rl.train --config "$config_path" "${overrides[@]}")
elif [[ ${#overrides[@]} -gt 0 ]]; then
    die "KEY=VALUE overrides only apply to the default trainer entrypoint; put them after -- instead"
fi

[[ -d "$working_dir" ]] || die "working dir '$working_dir' does not exist"

# Names of the variables to pass: the fixed list, $MCORE_RL_PASS_ENV, and --env ones; set ones only.
read -r -a user_pass <<< "${MCORE_RL_PASS_ENV:-}"
env_names=()
for name in "${PASS_ENV[@]}" "${user_pass[@]}" "${extra_env[@]}"; do
    if [[ -n "${!name+x}" ]]; then
        export "${name?}"
        env_names+=("$name")
    fi
done

runtime_env="$("$PYTHON" - "$working_dir" "${#EXCLUDES[@]}" "${EXCLUDES[@]}" "${env_names[@]}" <<'PY'
import json, os, sys
working_dir, n = sys.argv[1], int(sys.argv[2])
excludes, names = sys.argv[3:3 + n], sys.argv[3 + n:]
env = {k: os.environ[k] for k in names}
print(json.dumps({"working_dir": working_dir, "excludes": excludes, "env_vars": env}, sort_keys=True))
PY
)"

cmd=("$RAY_BIN" job submit --address "$address" --runtime-env-json "$runtime_env")
[[ -n "$submission_id" ]] && cmd+=(--submission-id "$submission_id")
[[ "$no_wait" == 1 ]] && cmd+=(--no-wait)
cmd+=(-- "${entrypoint[@]}")

if [[ "$dry_run" == 1 ]]; then
    echo "runtime_env: $runtime_env"
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi

ray_auth_setup require
exec "${cmd[@]}"
