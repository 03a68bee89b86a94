"""The GPU checks moved here from benchmarks/ (each also runs as a script, `scripts/gpu/session.sh`):
collected by pytest on a GPU machine, skipped elsewhere (tests/gpu/conftest.py). Figures:
docs/performance.md."""

from __future__ import annotations

import json

import torch

from tests.gpu import gpu_parity, ref_offload_check


def test_bf16_logits_as_close_to_fp32_as_transformers_own_bf16(tmp_path):
    out = tmp_path / "gpu_parity.json"
    assert gpu_parity.main(["--gpus", str(min(2, torch.cuda.device_count())), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["megatron_bf16"], "no layout ran"
    for case, err in res["megatron_bf16"].items():  # "layout/family"
        assert err <= 2 * res["hf_bf16"][case.split("/")[1]]["hf_bf16"] + 1e-3, (case, err)


def test_the_offloaded_reference_policy_scores_as_the_resident_one(tmp_path):
    out = tmp_path / "ref_offload.json"
    assert ref_offload_check.main(["--layers", "2", "--seq", "1024", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    resident, offloaded = res["rows"]
    assert offloaded["ref_repeat_max_abs"] == 0 and resident["ref_repeat_max_abs"] == 0
    assert res["saved_gib"] > 0
