"""A CPU run's actors name the missing optional accelerators once, at start, instead of megatron's
TransformerEngine/Apex fallback warnings (and other warnings of megatron's no user acts on)."""

from __future__ import annotations

import os
import subprocess
import sys

from mcore_rl.metrics import console
from tests.support import actor_pp_scenario as S
from tests.support.rl_batch import rl_batch
from tests.support.tiny_models import make_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SILENCED = ("not installed. Falling back", "full scope is deprecated", "that is not a leaf Tensor",
            "all_gather_into_tensor", "reduce_scatter_tensor")


def _start_and_update(rank, world, hf_dir):
    """Two actor ranks (EP=2): build, log-probs, one update (megatron's optimizer and grad clipping)."""
    from mcore_rl.actor import MegatronActor

    cfg = S.actor_cfg(1, 1, 2)
    cfg["critic"]["enabled"] = False
    actor = MegatronActor(rank, world, 0, hf_dir, cfg)
    batch = rl_batch()
    batch["old_log_probs"] = S.as_driver(actor.log_probs(batch))
    actor.update(batch)
    actor.ps.destroy_model_parallel()


def test_actors_name_missing_accelerators_once_and_nothing_else(tmp_path):
    make_hf_model("deepseek_v3", str(tmp_path / "hf"))
    code = ("from tests.support import distributed; from tests.e2e import test_quiet_start as t; "
            f"distributed.run(t._start_and_update, 2, 2, {str(tmp_path / 'hf')!r})")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert log.count(console.accelerators_line()) == 1, log[-3000:]
    assert console.accelerators_line().startswith("optional accelerators")
    loud = [s for s in SILENCED if s in log]
    assert not loud, f"{loud} in:\n{log[-3000:]}"
