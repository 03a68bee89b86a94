"""Engine processes write to log files under the run directory, not to the console.

Ray forwards every worker's stdout and stderr to the driver, where SGLang's and vLLM's start-up
output (quantization kernels that only run on CUDA, megatron's fallbacks, load progress), printed by
each engine process and again by Ray's de-duplication, buried the run's own lines. An engine actor
points its file descriptors, and so those of every process it spawns, at
`<output_dir>/logs/engine_<k>_node<n>.log` before it imports the engine, so Ray has nothing of it
to forward; the warnings that third-party imports raise on every start are left out there too.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

LOG_ENV = "MCORE_RL_ENGINE_LOG"  # the engine actor's log file, set per slot by EngineGroup

# what third-party packages warn about while an engine imports them on every start, none of it
# the user's to act on (message prefixes)
IMPORT_NOISE = (
    "Only CUDA",  # SGLang's AWQ / GGUF kernels on CPU
    "Transformer Engine and Apex are not installed",  # megatron-core, imported by the sync plugin
    "Apex is not installed",
    "Triton is not supported on current platform",
)


def log_file(log_dir: str, engine: int, node_rank: int) -> str:
    return os.path.join(log_dir, f"engine_{engine}_node{node_rank}.log")


def quiet_import_warnings() -> None:
    """Leave out IMPORT_NOISE in this process and, through PYTHONWARNINGS, in the ones it starts
    (SGLang's schedulers and vLLM's workers are spawned: filters set here do not reach them)."""
    for message in IMPORT_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(message))
    ours = [f"ignore:{m}" for m in IMPORT_NOISE]
    before = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w and w not in ours]
    os.environ["PYTHONWARNINGS"] = ",".join(before + ours)


def to_log_file(path: str | None = None) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2, which its children inherit)
    appended to `path` (default: $MCORE_RL_ENGINE_LOG; neither: left as they are)."""
    path = path or os.environ.get(LOG_ENV)
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    quiet_import_warnings()
