"""Colocated memory: the planner, NVML readings, the torch_memory_saver adapter, the choreography.

Import `mcore_rl.memory.saver` and call `decide()` before megatron-core is imported; the other
modules import megatron only when a plan needs the model's shapes.
"""
