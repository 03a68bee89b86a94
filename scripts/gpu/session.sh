#!/usr/bin/env bash
# On a lent GPU machine whose /tmp/sglang-site holds SGLang, Ray and megatron-core (see
# ../shared/tools/sglang-gpu and scripts/gpu/stage_extra.sh): run one part of the GPU evidence,
# writing logs and JSON under $OUT.  bash scripts/gpu/session.sh PART [PART ...]
# On a machine of several GPUs, `bash scripts/gpu/side_by_side.sh` runs one such session per GPU.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
export PYTHONPATH=/tmp/sglang-site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export NCCL_CUMEM_ENABLE=0  # cuMem P2P between processes that each see one GPU failed here ('invalid argument')
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
quiet() { grep -v "Ignore import\|SyntaxWarning\|warnings.warn\|quant_api\|Configuration class\|UserWarning"; }
train() {  # name, then overrides
  local name=$1; shift
  timeout 420 python3 -m mcore_rl.train --config configs/tiny_gpu.yaml trainer.output_dir="/tmp/$name" \
    trainer.save_freq=-1 "$@" 2>&1 | quiet > "$OUT/$name.log"
  cp "/tmp/$name/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null
  python3 - "$OUT/$name.jsonl" "$name" <<'PY'
import json, statistics, sys
steps = {}
for line in open(sys.argv[1]):
    r = json.loads(line); steps.setdefault(r["step"], {}).update(r)
tr = [s for k, s in sorted(steps.items()) if k > 0 and "reward/mean" in s]
m = lambda k: round(statistics.median(s[k] for s in tr[1:] if k in s), 4)
print(sys.argv[2], "steps", len(tr), "reward first3", round(sum(s["reward/mean"] for s in tr[:3]) / 3, 3),
      "last3", round(sum(s["reward/mean"] for s in tr[-3:]) / 3, 3), "first sync", steps[0].get("sync/verified"),
      "logp diff max", round(max(s["rollout/logp_diff_abs_mean"] for s in tr), 5), "median step", m("timing/step"),
      "rollout", m("timing/rollout"), "sync", m("sync/seconds"), "to_rollout", m("timing/to_rollout"),
      "NVML GiB max train/sync/rollout", [round(max(s.get(f"memory/gpu_peak_gib_{p}") or 0 for s in tr), 2)
                                          for p in ("train", "sync", "rollout")])
PY
}
keep_run() {  # KEEP=1 (full27, loopx): the run's last step saves the model, no optimizer state, into /tmp/full27_run
  KEEP_RUN=()  # for export27
  [ -n "${KEEP:-}" ] || return 0
  rm -rf /tmp/full27_run
  KEEP_RUN=(--run-dir /tmp/full27_run)
  EXTRA+=(trainer.save_last=true trainer.save_optimizer=false)
}
read -r -a EXTRA <<< "${EXTRA_OVERRIDES:-}"
read -r -a FP8 <<< "${FP8_ARGS:-}"
PY=(python3)  # PYSPY=1: the benchmark's driver under py-spy (staged by scripts/gpu/stage_extra.sh), raw stacks to $OUT
if [ -n "${PYSPY:-}" ]; then  # a container without ptrace rights would lose the run: probe first
  if /tmp/gpu-extra/py-spy record -o /dev/null -d 1 -- sleep 2 >/dev/null 2>&1; then
    PY=(/tmp/gpu-extra/py-spy record -o "$OUT/driver_pyspy${TAG:-}.txt" --format raw -r 25 --threads --nonblocking -- python3)
  else echo "PYSPY: py-spy cannot sample here; running without it"; fi
fi
# per-process memory while the parts run: host RSS (top 12) and each process's GPU memory
(while sleep 1; do date +%T; ps -eo pid,rss,comm --sort=-rss | head -12
   nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; done > "$OUT/proc_mem.log" 2>&1) &
SAMPLER=$!
trap 'kill $SAMPLER 2>/dev/null' EXIT
{ date; df -h /tmp /dev/shm; free -g; } > "$OUT/machine.log" 2>&1
for part in "$@"; do
  rm -rf "${TMPDIR:-/tmp}"/rl_loop_bench_* "${TMPDIR:-/tmp}"/rl_loop_modes_*  # a failed bench's checkpoints (tens of GB) stay otherwise
  case $part in
    colocated) train colocated cluster.n_gpus_per_node=2 parallel.ep=2 rollout.tp_size=2 actor.micro_batch_size=64 trainer.total_training_steps=20 ;;
    separate) train separate cluster.n_gpus_per_node=2 cluster.colocate=false cluster.rollout_gpus=1 trainer.total_training_steps=20 ;;
    single) train single trainer.total_training_steps=30 ;;
    planned) train planned memory.auto_mem_fraction=true trainer.total_training_steps="${STEPS:-25}" \
               rollout.log_level="${ENGINE_LOG:-error}" ;;
    planned_nocap)  # the same without the plan's KV-token cap: what the cap prevents
      rm -rf /tmp/nocap && cp -r . /tmp/nocap
      sed -i 's/args\["max_total_tokens"\] = kv_tokens/pass/' /tmp/nocap/mcore_rl/rollout/sglang.py
      (cd /tmp/nocap && PYTHONPATH=/tmp/sglang-site:/tmp/nocap train planned_nocap memory.auto_mem_fraction=true \
         trainer.total_training_steps=3 rollout.log_level=info; grep -iE "KV Cache is allocated|max_total_num|refused|out of memory|Error" \
         "$OUT/planned_nocap.log" | head -20) ;;
    multinode) timeout 580 python3 tests/support/multinode_scenario.py --device gpu --steps 3 --parts colocated \
                 --out "$OUT/multinode_colocated.json" 2>&1 | quiet | tail -30 ;;
    multinode_separate) timeout 580 python3 tests/support/multinode_scenario.py --device gpu --steps 3 --parts separate \
                 --out "$OUT/multinode_separate.json" 2>&1 | quiet | tail -30 ;;
    actor) timeout 580 python3 benchmarks/actor_bench.py --gpus 2 --layers 8 --budget 16384 --micro-batches 6 --steps 2 \
             --checks --profile --runs baseline,sdpa,optimized --out "$OUT/actor_h200x2.json" 2>&1 | quiet | tail -60 ;;
    actor_memory) timeout 580 python3 benchmarks/actor_bench.py --gpus 2 --layers 8 --budget 16384 --steps 1 \
             --runs recompute_full,recompute_half,recompute_moe,offload,grad_bf16 --out "$OUT/actor_memory_h200x2.json" \
             2>&1 | quiet | tail -20 ;;
    pinned_fork)  # may a forked checkpoint writer read the pinned offload buffers? (CUDA may mark them don't-fork)
      python3 - <<'PY'
import os, torch
from mcore_rl.memory.offload import PinnedBuffer
b = PinnedBuffer(1 << 28); b.tensor.fill_(7)
t = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True); t.fill_(7)
for name, x in (("PinnedBuffer", b.tensor), ("pin_memory", t)):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if int(x[12345]) == 7 else 3)
    print(name, "read in a forked child: exit status", os.waitpid(pid, 0)[1], flush=True)
PY
      ;;
    # loop1gpu: CONFIG=configs/qwen3_30b_a3b_1gpu.yaml needs LIMIT of 250 s at 2 layers and more than 300 at 4
    # beside another session (ninth pass); EXTRA_OVERRIDES=rollout.sync_load=direct for the direct engine load;
    # MCORE_RL_PROFILE_SYNC=3: the third sync under cProfile, its table in $OUT/loop_*.log
    loop1gpu) timeout "${LIMIT:-590}" "${PY[@]}" benchmarks/rl_loop_bench.py --config "${CONFIG:-configs/moonlight_2gpu.yaml}" \
                --out "$OUT/loop_${LAYERS:-4}L${TAG:-}.json" ${NO_ALONE:+--no-engine-alone} \
                cluster.n_gpus_per_node=1 parallel.ep=1 rollout.tp_size=1 model.hf_config.num_hidden_layers="${LAYERS:-4}" \
                trainer.total_training_steps="${STEPS:-3}" "${EXTRA[@]}" 2>&1 | quiet | tee "$OUT/loop_${LAYERS:-4}L${TAG:-}.log" \
                | tail -60 ;;
    async2gpu)  # issue 26 on two GPUs (nvidia-h100-x2): the trainer on one, SGLang on the other, samples/s per
      # mode. Random weights sample near-uniformly, so 1,800 extra stop ids (1.1 % of the vocab) give
      # geometric response lengths: median about 63 tokens, one in 256 past 8x that (cap 512).
      # STALENESS=1 gives a step's groups one step's time to finish, less than a 512-token response
      # takes: 0.86x sync; 2 gave 1.32x and 4 1.53x (docs/performance.md).
      STOPS=$(python3 -c 'print(",".join(map(str, range(1000, 2800))))')
      timeout "${LIMIT:-590}" "${PY[@]}" benchmarks/rl_loop_bench.py --config configs/moonlight_2gpu.yaml \
        --out "$OUT/modes_2gpu${TAG:-}.json" --modes "${MODES:-sync,one_step_off,fully_async}" \
        cluster.n_gpus_per_node=2 cluster.colocate=false cluster.rollout_gpus=1 parallel.ep=1 rollout.tp_size=1 \
        "rollout.stop_token_ids=[$STOPS]" rollout.max_response_len=512 trainer.save_freq=-1 trainer.save_last=false \
        data.task_val_size=32 trainer.partial_rollout_tokens="${SEGMENT:-64}" trainer.max_staleness="${STALENESS:-1}" \
        trainer.total_training_steps="${STEPS:-5}" "${EXTRA[@]}" 2>&1 | quiet | tee "$OUT/modes_2gpu${TAG:-}.log" | tail -40 ;;
    fp8_speed)  # issue 28: SGLang alone on dummy weights with trained-like routing, bf16 then FP8, at a real depth
      # (Moonlight: 27 layers); FP8_ARGS for the FP8 engines' kernels and the rest, e.g. "--deep-gemm --profile-steps 20
      # --kinds bf16,fp8,fp8:moe_runner_backend=cutlass" or "--routing dummy" (the dummy load's: all tokens on 6 experts)
      timeout "${LIMIT:-590}" python3 benchmarks/engine_bench.py speed --config "${CONFIG:-configs/moonlight_2gpu.yaml}" \
        --out "$OUT/fp8_speed_${LAYERS:-27}L${TAG:-}.json" --layers "${LAYERS:-27}" --batch "${BATCH:-128}" \
        --new-tokens 512 ${MOE_DIR:+--moe-config-dir "$MOE_DIR"} "${FP8[@]}" 2>&1 | quiet | tee "$OUT/fp8_speed${TAG:-}.log" | tail -40 ;;
    moe_tune)  # issue 28: SGLang's fused-MoE tiles for Moonlight's experts on this GPU, into /tmp/moe_configs
      # (then MOE_DIR=/tmp/moe_configs TAG=_tuned ... fp8_speed, or EXTRA_OVERRIDES=rollout.moe_config_dir=... loop1gpu;
      # 64 FP8 tiles and 128 bf16 ones, each compiled: DTYPES=fp8 and DTYPES=bf16 in calls of their own if one is cut;
      # decode batches up to 1024 tokens by default, TUNE_BATCHES for others)
      timeout "${LIMIT:-590}" python3 scripts/tune_fused_moe.py --config "${CONFIG:-configs/moonlight_2gpu.yaml}" \
        --dir /tmp/moe_configs --out "$OUT/moe_tune${TAG:-}.json" --dtypes "${DTYPES:-fp8,bf16}" \
        --batches "${TUNE_BATCHES:-1,8,16,32,64,128,256,512,1024}" rollout.tp_size=1 \
        rollout.ep_size=1 2>&1 | quiet | tee "$OUT/moe_tune${TAG:-}.log" | tail -40 ;;
    resume_check)  # issue 24: a resumed run's next step against the uninterrupted run's, on the same batch
      # (about 2.9 checkpoints on disk: LAYERS=4 needs the 128 GiB of a 2-GPU machine, LAYERS=2 fits 64 GiB;
      # LAYERS=2 took 325-465 s on an H100; random weights score 0, so an entropy bonus gives the step a gradient)
      timeout "${LIMIT:-590}" python3 tests/gpu/resume_check.py --config configs/moonlight_2gpu.yaml \
        --out "$OUT/resume_${LAYERS:-4}L.json" cluster.n_gpus_per_node=1 parallel.ep=1 rollout.tp_size=1 \
        model.hf_config.num_hidden_layers="${LAYERS:-4}" actor.entropy_coeff=0.01 "${EXTRA[@]}" 2>&1 | quiet | tail -40 ;;
    driver_cuda)  # does the driver's memory plan start a CUDA context (it holds GPU memory all run)?
      python3 -c "import torch; from mcore_rl.config import sections as C; from mcore_rl.memory.plan import plan_for_config
cfg = C.load_config('configs/moonlight_2gpu.yaml', ['cluster.n_gpus_per_node=1', 'parallel.ep=1', 'rollout.tp_size=1'])
plan_for_config(cfg); print('CUDA initialized by the plan:', torch.cuda.is_initialized())" 2>&1 | tail -1 ;;
    run50)  # Moonlight widths, 4 layers, one GPU: steps up to STEPS in /tmp/run50 (resumes what is there);
      # one checkpoint kept (33 GiB each: three did not fit beside another GPU's session)
      timeout 590 python3 -m mcore_rl.train --config configs/moonlight_2gpu.yaml trainer.output_dir=/tmp/run50 \
        cluster.n_gpus_per_node=1 parallel.ep=1 rollout.tp_size=1 trainer.total_training_steps="${STEPS:-25}" \
        trainer.save_freq=10 trainer.max_checkpoints=1 trainer.test_freq=-1 trainer.val_before_train=false "${EXTRA[@]}" 2>&1 | quiet \
        | grep -v "^step .* | timing/" | cut -c1-400 | tail -25
      cp /tmp/run50/metrics.jsonl "$OUT/run50_metrics.jsonl"; ls /tmp/run50/checkpoints ;;
    full27)  # issue 45: the whole Moonlight (27 layers) on 4 GPUs (nvidia-h200-x4; CONFIG=configs/moonlight_4gpu_h100.yaml
      # on nvidia-h100-x4), one engine layout a call: LAYOUT=tp1 (4 x TP1), tp4 (1 x TP4), tp4ep4 (1 x TP4, EP 4 inside
      # the engine), tp4dp4ep4 (1 x TP4 with DP attention: each GPU its own requests, whole attention; EP 4) or tp4x2nodes (1 x TP4 over two raylets of 2 GPUs on this host, the engine's nnodes=2; each
      # "node" plans half the host's RAM: HOST_GB where MemTotal starts small); R3=1 with actor.routing_replay=true. JSON (phase seconds, start, memory
      # against the plan, first sync read-back, log-prob gap), console log and engine logs under $OUT/full27_*
      FULL=(rollout.tp_size=1); RUN=()
      case ${LAYOUT:-tp1} in
        tp1) ;;
        tp4) FULL=(rollout.tp_size=4) ;;
        tp4ep4) FULL=(rollout.tp_size=4 rollout.ep_size=4) ;;
        tp4dp4ep4) FULL=(rollout.tp_size=4 rollout.ep_size=4 rollout.dp_attention=true) ;;
        tp4x2nodes) FULL=(cluster.nnodes=2 cluster.n_gpus_per_node=2 rollout.tp_size=4
                          cluster.host_memory_gb=$(( ${HOST_GB:-$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)} / 2 )))
                    RUN=(python3 scripts/gpu/raylets.py --nodes 2 --gpus-per-node 2 --) ;;
        *) echo "full27: unknown LAYOUT=$LAYOUT (tp1, tp4, tp4ep4, tp4dp4ep4, tp4x2nodes)"; exit 2 ;;
      esac
      name=full27_${LAYOUT:-tp1}${R3:+_r3}${TAG:-}
      keep_run
      timeout "${LIMIT:-590}" "${RUN[@]}" "${PY[@]}" benchmarks/rl_loop_bench.py --config "${CONFIG:-configs/moonlight_4gpu.yaml}" \
        --out "$OUT/$name.json" --logs "$OUT/${name}_engine_logs" "${KEEP_RUN[@]}" --no-engine-alone "${FULL[@]}" \
        trainer.total_training_steps="${STEPS:-3}" ${R3:+actor.routing_replay=true} "${EXTRA[@]}" 2>&1 | quiet \
        | tee "$OUT/$name.log" | tail -60
      ls "${HOME}/.cache/mcore_rl/jit" 2>/dev/null | sed 's/^/jit cache: /' ;;
    random_hf27)  # issue 45 item 1: an HF checkpoint of random weights at CONFIG's full size (the converter's random-hf,
      # bf16, ~30 GB for Moonlight) at HF27 (/tmp/moonlight27_hf), once; hfstart27 starts from it
      HF27=${HF27:-/tmp/moonlight27_hf}
      python3 -c "import sys; from mcore_rl.config.sections import load_config; from mcore_rl.loop.startup import prepare_model
prepare_model(load_config(sys.argv[1]), sys.argv[2])" "${CONFIG:-configs/moonlight_4gpu.yaml}" /tmp/hf27_cfg
      { time timeout "${LIMIT:-590}" python3 -m mcore_rl.convert random-hf --hf-config /tmp/hf27_cfg/init_hf --out "$HF27" \
          --dtype bf16; } 2>&1 | quiet | tail -5 | tee "$OUT/random_hf27.log"; du -sh "$HF27" ;;
    hfstart27)  # issue 45 item 1: full27 (LAYOUT) started from random_hf27's checkpoint instead of megatron's seeded init:
      # each trainer rank reads only its own shard of it (the console's "reading the initial weights" phase and its
      # "initial weights:" line: GiB a rank, seconds); compare its start with full27's. COLD=1 drops the page cache first
      HF27=${HF27:-/tmp/moonlight27_hf}
      [ -f "$HF27/model.safetensors.index.json" ] || { echo "hfstart27: no checkpoint at $HF27 (run random_hf27 first)"; exit 2; }
      [ -n "${COLD:-}" ] && { sync; echo 3 > /proc/sys/vm/drop_caches || echo "COLD: cannot drop the page cache here"; }
      TAG=_hf${COLD:+_cold}${TAG:-} EXTRA_OVERRIDES="model.hf_config=null model.hf_path=$HF27 ${EXTRA_OVERRIDES:-}" \
        bash scripts/gpu/session.sh full27 ;;
    first_step)  # issue 45: the first step of a TP > 1 engine disagrees with the trainer (docs/performance.md). At
      # LAYERS (4), where a healthy engine's live gap is 0.03, one engine of TP FS_TP (4) over the node of CONFIG
      # (configs/moonlight_4gpu.yaml; configs/moonlight_2gpu.yaml with FS_TP=2 on 2 GPUs), every sync read back and
      # probed (rollout.verify_sync_probe: the trainer's and the engine's log-probs of fixed sequences through the
      # engine's prefill, colocated once the KV cache is back). VARIANTS (base no_custom_ar): base; no_custom_ar
      # (SGLang's custom all-reduce off); no_cuda_graph (decode eager); flashinfer (its attention backend). Compare
      # sync/probe_gap_mean of step 0 (the first sync) with steps 1-2, and rollout/logp_diff_abs_mean (the decode's)
      # of step 1 with step 2, in each JSON
      for variant in ${VARIANTS:-base no_custom_ar}; do
        case $variant in
          base) v=() ;;
          no_custom_ar) v=(rollout.engine_kwargs.disable_custom_all_reduce=true) ;;
          no_cuda_graph) v=(rollout.engine_kwargs.disable_cuda_graph=true) ;;
          flashinfer) v=(rollout.attention_backend=flashinfer) ;;
          *) echo "first_step: unknown variant $variant"; exit 2 ;;
        esac
        name=first_step_${variant}_L${LAYERS:-4}
        ray stop --force >/dev/null 2>&1
        timeout "${LIMIT:-300}" python3 benchmarks/rl_loop_bench.py --config "${CONFIG:-configs/moonlight_4gpu.yaml}" \
          --out "$OUT/$name.json" --logs "$OUT/${name}_logs" --no-engine-alone \
          rollout.tp_size="${FS_TP:-4}" model.hf_config.num_hidden_layers="${LAYERS:-4}" trainer.total_training_steps=3 \
          rollout.verify_sync_every=1 rollout.verify_sync_probe=true memory.offload_train_states=auto "${v[@]}" "${EXTRA[@]}" \
          2>&1 | quiet \
          | tee "$OUT/$name.log" | tail -25
        python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print('$name', 'step', r.get('step'), {k: round(v, 4) for k, v in r.items() if isinstance(v, float) and
          k in ('sync/probe_gap_mean', 'sync/probe_gap_max', 'rollout/logp_diff_abs_mean', 'sync/verified')})" \
          < "$OUT/${name}_logs/metrics.jsonl" || true
      done ;;
    first_sync_state)  # issue 45: which of a TP > 1 engine's tensors the first sync leaves stale, and whether a second
      # sync or a release and resume puts them right (tests/gpu/first_sync_state.py); LAYERS (4), FS_TP (2), CONFIG
      ray stop --force >/dev/null 2>&1
      timeout "${LIMIT:-300}" python3 tests/gpu/first_sync_state.py --config "${CONFIG:-configs/moonlight_2gpu.yaml}" \
        --out "$OUT/first_sync_state${TAG:-}.json" rollout.tp_size="${FS_TP:-2}" model.hf_config.num_hidden_layers="${LAYERS:-4}" \
        memory.offload_train_states=auto "${EXTRA[@]}" 2>&1 | quiet | tee "$OUT/first_sync_state${TAG:-}.log" | tail -20 ;;
    hidden_gap)  # issue 45 item 5: engine against trainer, layer by layer, on the same weights and tokens, 27 Moonlight
      # layers (the trainer's model on GPU 0, one SGLang engine of TP=1 on the last GPU, or beside it on one GPU);
      # live routing, R3, and R3 with megatron's bf16 RoPE/SwiGLU (the A/B of the fp32 ones). On one GPU (no disk for a
      # second copy): EXTRA_OVERRIDES="model.hf_config=null model.hf_path=/tmp/moonlight27_hf" after random_hf27
      timeout "${LIMIT:-590}" python3 benchmarks/engine_bench.py hidden-gap --config "${CONFIG:-configs/moonlight_4gpu.yaml}" \
        --out "$OUT/hidden_gap${TAG:-}.json" --tokens "${TOKENS:-256}" --replay --megatron-elementwise \
        rollout.tp_size=1 rollout.ep_size=1 \
        "${EXTRA[@]}" 2>&1 | quiet | tee "$OUT/hidden_gap${TAG:-}.log" | tail -75 ;;
    export27)  # issue 45 item 7: the model a `KEEP=1 full27` run trained, exported by the converter's command line, loaded by
      # SGLang as its model (TP 1, the last GPU), its log-probs against the trainer's (that checkpoint, GPU 0), live and R3
      step=$(ls -d /tmp/full27_run/checkpoints/step_* 2>/dev/null | sort -t_ -k2 -n | tail -1)
      [ -n "$step" ] || { echo "export27: no checkpoint under /tmp/full27_run (run KEEP=1 full27 first)"; exit 2; }
      timeout "${LIMIT:-590}" python3 benchmarks/engine_bench.py hidden-gap --config "${CONFIG:-configs/moonlight_4gpu.yaml}" \
        --out "$OUT/export27${TAG:-}.json" --tokens "${TOKENS:-256}" --replay --checkpoint "$step" rollout.tp_size=1 \
        rollout.ep_size=1 "${EXTRA[@]}" 2>&1 | quiet | tee "$OUT/export27${TAG:-}.log" | tail -75 ;;
    loopx)  # the loop on CONFIG with EXTRA_OVERRIDES as given, as NAME; RAYLETS=NxG runs it over N raylets of G GPUs
      # (the engine's nnodes=N when its TP spans them), e.g. the 2 x H200 engine layouts at the depth that fits there
      RUN=(); [ -n "${RAYLETS:-}" ] && RUN=(python3 scripts/gpu/raylets.py --nodes "${RAYLETS%x*}" --gpus-per-node "${RAYLETS#*x}" --)
      keep_run
      timeout "${LIMIT:-590}" "${RUN[@]}" python3 benchmarks/rl_loop_bench.py --config "${CONFIG:-configs/moonlight_2gpu.yaml}" \
        --out "$OUT/${NAME:-loopx}.json" --logs "$OUT/${NAME:-loopx}_logs" "${KEEP_RUN[@]}" --no-engine-alone "${EXTRA[@]}" 2>&1 | quiet \
        | tee "$OUT/${NAME:-loopx}.log" | tail -60 ;;
    loop) timeout 580 python3 benchmarks/rl_loop_bench.py --config configs/moonlight_2gpu.yaml --out "$OUT/loop_moonlight_2gpu.json" 2>&1 | quiet | tail -30 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
