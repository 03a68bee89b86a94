# Runs at the start of every Python process that has this directory on PYTHONPATH (SGLang's
# engine processes on CPU): installs mcore_rl's CPU stand-ins before SGLang is imported.
import os

if os.environ.get("MCORE_RL_SGLANG_CPU") == "1":
    from mcore_rl.rollout.sglang_cpu import install

    install()
