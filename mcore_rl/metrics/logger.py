"""Per-step metrics to the console, metrics.jsonl, TensorBoard and (optionally) Weights & Biases.

    with MetricsLogger(run_dir, ["console", "jsonl", "tensorboard"], config=to_dict(cfg)) as log:
        log.log(metrics, step)   # one record a step

The names are the ones mcore_rl.train logs (reward/mean, actor/entropy, timing/rollout, sync/seconds,
memory/gpu_peak_gib_train, ...; mcore_rl.metrics.plot draws them). Secrets never
reach any sink: the values of environment variables whose names contain KEY/TOKEN/SECRET/
PASSWORD/CREDENTIAL are masked wherever they appear, and config or metric keys that end in
such a word (api_key, hf_token, password) are masked or dropped.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
import time
from typing import Any, Iterable, Mapping

import torch
import yaml

SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
# a key is secret when its last word is one of these: "wandb_api_key" is, "ppo_max_token_len" is not
SECRET_WORDS = {"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS"}
MASK = "***"
BACKENDS = ("console", "jsonl", "tensorboard", "wandb")
# environment variables worth recording with a run (after secret filtering)
RUN_ENV_PREFIXES = ("CUDA_", "NCCL_", "RAY_", "MASTER_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "OMP_",
                    "PYTORCH_", "SGLANG_", "HF_HUB_OFFLINE")


def is_secret_env_name(name: str) -> bool:
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def is_secret_key(name) -> bool:
    words = [w for w in re.split(r"[^A-Za-z0-9]+", str(name)) if w]
    return bool(words) and words[-1].upper() in SECRET_WORDS


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of environment variables whose names look secret (long enough to be meaningful)."""
    environ = os.environ if environ is None else environ
    found = {v for k, v in environ.items() if is_secret_env_name(k) and len(v) >= 6}
    return sorted(found, key=len, reverse=True)  # longest first, so that no part of one survives


def redact(obj: Any, secrets: Iterable[str]) -> Any:
    """Copy of a nested dict/list with secret-named keys masked and secret values replaced."""
    secrets = list(secrets)
    if isinstance(obj, Mapping):
        return {redact(k, secrets): MASK if is_secret_key(k) else redact(v, secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v, secrets) for v in obj]
    if isinstance(obj, str):
        for secret in secrets:
            obj = obj.replace(secret, MASK)
    return obj


def _scalar(value) -> float | int | None:
    if isinstance(value, torch.Tensor):
        value = value.detach().float().mean().item() if value.numel() != 1 else value.item()
    if hasattr(value, "item"):  # numpy scalars
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return None


def run_info() -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith(RUN_ENV_PREFIXES) and not is_secret_env_name(k)}
    return {"argv": sys.argv, "host": platform.node(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "env": env,
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


class MetricsLogger:
    """Fan-out of per-step scalar metrics. Writes into `output_dir`:
    metrics.jsonl (one {"step", "time", ...metrics} record per log call), config.yaml,
    run_info.json, tensorboard/ (event files)."""

    def __init__(self, output_dir: str, backends: Iterable[str] = ("console", "jsonl"), *,
                 project: str = "mcore_rl", experiment: str = "default", config: Mapping | None = None,
                 stream=None):
        self.backends = list(backends)
        unknown = set(self.backends) - set(BACKENDS)
        if unknown:
            raise ValueError(f"unknown logger backend(s) {sorted(unknown)}; known: {list(BACKENDS)}")
        self.output_dir, self.stream = output_dir, stream or sys.stdout
        self._secrets = secret_values()
        os.makedirs(output_dir, exist_ok=True)
        self._write_text("run_info.json", json.dumps(redact(run_info(), self._secrets), indent=2))
        safe_config = redact(dict(config or {}), self._secrets)
        if config is not None:
            self._write_text("config.yaml", yaml.safe_dump(safe_config, sort_keys=False))
        self._jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a") if "jsonl" in self.backends else None
        self._tb = None
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(output_dir, "tensorboard"))
        self._wandb = self._init_wandb(project, experiment, safe_config) if "wandb" in self.backends else None

    def _write_text(self, name: str, text: str) -> None:
        with open(os.path.join(self.output_dir, name), "w") as f:
            f.write(text)

    def _init_wandb(self, project: str, experiment: str, config: dict):
        try:
            import wandb
        except ImportError:
            print("[metrics] wandb is not installed; skipping the wandb logger", file=self.stream)
            return None
        # wandb reads its API key from the environment itself; we never pass or log it
        return wandb.init(project=project, name=experiment, config=config, dir=self.output_dir)

    def _clean(self, metrics: Mapping) -> dict[str, float | int | None]:
        clean = {}
        for key, value in metrics.items():
            if is_secret_key(key):
                continue
            scalar = _scalar(value)
            if scalar is None:
                continue
            clean[redact(str(key), self._secrets)] = scalar if math.isfinite(scalar) else None
        return clean

    def log(self, metrics: Mapping[str, Any], step: int) -> dict:
        """Log scalar metrics (numbers, 0-d tensors; others are skipped) for `step`; returns them."""
        clean = self._clean(metrics)
        if "console" in self.backends:
            fields = " | ".join(f"{k}: {v:.4g}" if v is not None else f"{k}: nan" for k, v in sorted(clean.items()))
            print(f"step {step} | {fields}", file=self.stream, flush=True)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if value is not None:
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        return clean

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
