"""Rollout engines behind one interface (`base.Rollout`), one file per engine.

- `embedded`: samples on the Megatron actors' own shards (laptops, CI without an engine).
- `sglang`: SGLang's engine in Ray actors, one per node of each data-parallel engine
  (`sglang_cpu` / `sglang_plugin` / `sglang_site`: what it needs on CPU and in its processes).
- `vllm`: vLLM's engine in Ray actors, one per data-parallel engine (`vllm_worker`: the weight
  updates inside its worker processes); `model_files`: the model directory both engines read.
- `group`: data-parallel engines as Ray actors (batching, deadlines, weight targets);
  `placement` / `launch`: which GPUs each engine gets and starting them; `weights`: the driver's
  side of the weight sync, with read-back verification.
"""

from mcore_rl.rollout.base import Completion, EngineError, Rollout, SamplingParams

__all__ = ["Completion", "EngineError", "Rollout", "SamplingParams"]
