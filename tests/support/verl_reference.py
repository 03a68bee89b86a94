"""Load verl's own implementations to serve as an independent reference in tests.

verl cannot live in the main venv (it pins transformers < 5.11), so unless `import verl` already
works, the pinned wheel and the few light modules its `core_algos` imports are installed on the
side by tests/support/side_install.py (environment variables and the fail-by-default policy are described
there; <NAME> is VERL). `python -m tests.support.verl_reference` installs and imports up front, exiting
non-zero on failure.
"""

from __future__ import annotations

from tests.support.side_install import SideInstall

VERL_VERSION = "0.9.1"
# what verl.trainer.ppo.core_algos and verl.utils.reward_score import beyond the main venv
SIDE = SideInstall("verl", VERL_VERSION, (
    f"verl=={VERL_VERSION}", "tensordict==0.10.0", "omegaconf==2.4.0", "antlr4-python3-runtime==4.9.3",
    "pyvers==0.2.3", "cloudpickle==3.1.2", "codetiming==1.4.0", "orjson==3.13.0"), probe="verl", timeout_s=600)

REFERENCE_MODULES = ("verl.trainer.ppo.core_algos", "verl.utils.reward_score.gsm8k",
                     "verl.utils.reward_score.math_reward")


def verl_module(module: str):
    """Import a verl module (installing verl on the side if needed), or fail the calling test
    (skip it under MCORE_RL_NO_SIDE_INSTALL=1)."""
    return SIDE.require(module)


if __name__ == "__main__":
    SIDE.main(REFERENCE_MODULES)
