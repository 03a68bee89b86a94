"""Rule rewards (GSM8K, MATH, tasks): hand cases, agreement with verl's scorers, preprocess scripts."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mcore_rl.data import read_rows
from mcore_rl.data.rewards import (compute_score, gsm8k_extract, gsm8k_score, last_boxed, math_score,
                              normalize_math_answer, register_reward)
from tests.support.verl_reference import verl_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GSM8K_CASES = [  # (response, ground truth)
    ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("Total: 1,234 dollars\n#### 1,234", "1234"),
    ("#### -5", "-5"),
    ("answer ####72", "72"),  # no space: strict finds nothing, flexible finds 72
    ("first #### 3 then corrected #### 4", "4"),
    ("The cost is $18.00.", "18"),
    ("#### 18.00", "18"),  # string equality, like verl
    ("no number here", "1"),
    ("x" * 400 + " #### 9", "9"),
    ("#### 12 " + "pad " * 100, "12"),  # answer beyond the scanned tail
    ("The answer is 5. #### $5", "5"),
]
MATH_CASES = [
    ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}"),
    ("\\boxed{0.5}", "\\frac12"),
    ("\\boxed{.5}", "\\frac{1}{2}"),
    ("\\boxed{x = 3}", "3"),
    ("\\boxed{10\\%}", "10"),
    ("\\boxed{90^\\circ}", "90"),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"),
    ("\\boxed{3/4}", "\\frac{3}{4}"),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}"),
    ("\\boxed{5 \\text{ cm}}", "5"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("first \\boxed{1} then \\boxed{2}", "1"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
    ("The answer is $\\boxed 7$.", "7"),
    ("\\boxed{4", "4"),  # cut off: unbalanced
    ("no box 4", "4"),
    ("\\boxed{\\$5}", "5"),
    ("\\boxed{\\text{(B)}}", "\\text{(B)}"),
    ("\\boxed{2}", "3"),
]
# where we knowingly differ from verl 0.9.1: (response, ground truth, our score, verl's score)
MATH_DELIBERATE_DIFFERENCES = [
    ("\\fbox{7}", "7", 1.0, 0.0),  # verl finds the \fbox answer but then fails to unwrap it
]


def test_gsm8k_extraction_by_hand():
    assert gsm8k_extract("so #### 1,234") == "1234"
    assert gsm8k_extract("so ####1234") is None
    assert gsm8k_extract("so ####1234", "flexible") == "1234"
    assert gsm8k_extract("costs 3, then 4.", "flexible") == "4."
    assert gsm8k_score("#### 72", "72") == 1.0 and gsm8k_score("#### 71", "72") == 0.0
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1
    with pytest.raises(ValueError, match="flexible"):
        gsm8k_extract("x", "loose")


def test_math_boxed_and_normalisation_by_hand():
    assert last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\boxed{1} and \\boxed{{2}}") == "{2}"
    assert last_boxed("\\boxed{1") is None and last_boxed("none") is None
    assert normalize_math_answer("\\dfrac{3}{4}") == normalize_math_answer("3/4") == "\\frac{3}{4}"
    assert normalize_math_answer("k = \\frac12") == "\\frac{1}{2}"
    assert math_score("\\boxed{\\left(2, 3\\right)}", "(2,3)") == 1.0
    assert math_score("\\boxed{2}", "\\frac{1}{2}") == 0.0


def test_dispatch_by_data_source():
    assert compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert compute_score(source, "\\boxed{3}", "3") == 1.0
    assert compute_score("mcore_rl/copy_last", "d$", "d") == 1.0
    assert compute_score("mcore_rl/copy_last", "$d", "d") == 0.0
    with pytest.raises(NotImplementedError, match="register_reward"):
        compute_score("my/dataset", "x", "y")
    register_reward("my/dataset", lambda s, gt: float(gt in s))
    assert compute_score("my/dataset", "xyz", "y") == 1.0


def test_gsm8k_and_math_scores_match_verl():
    verl_gsm8k = verl_module("verl.utils.reward_score.gsm8k")
    verl_math = verl_module("verl.utils.reward_score.math_reward")
    for response, truth in GSM8K_CASES:
        for method in ("strict", "flexible"):
            assert gsm8k_score(response, truth, method) == verl_gsm8k.compute_score(response, truth, method), \
                (response, method)
    for response, truth in MATH_CASES:
        assert math_score(response, truth) == verl_math.compute_score(response, truth), response
    for response, truth, ours, theirs in MATH_DELIBERATE_DIFFERENCES:
        assert (math_score(response, truth), verl_math.compute_score(response, truth)) == (ours, theirs)


# ----------------------------------------------------------------------------- preprocess scripts
def run_script(name, *args, env=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=120)


GSM8K_RECORDS = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
                 {"question": "A shop sells 1,200 pens a day for 2 days. Total?", "answer": "#### 2,400"}]


def test_preprocess_gsm8k_from_hf_parquet_layout(tmp_path):
    raw = tmp_path / "raw"
    for subset, records in (("main", GSM8K_RECORDS), ("socratic", GSM8K_RECORDS[:1])):
        (raw / subset).mkdir(parents=True)
        for split in ("train", "test"):
            pq.write_table(pa.Table.from_pylist(records), raw / subset / f"{split}-00000-of-00001.parquet")
    out = tmp_path / "out"
    proc = run_script("preprocess_gsm8k.py", "--local_dir", str(raw), "--output_dir", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = read_rows(str(out / "train.parquet"))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "2400"]  # only the "main" subset
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["ability"] == "math"
    assert rows[0]["prompt"][0]["role"] == "user" and "Tom has 3 apples" in rows[0]["prompt"][0]["content"]
    assert rows[1]["extra_info"]["split"] == "train" and rows[1]["extra_info"]["index"] == 1
    # the reference solution earns the reward it should
    assert all(compute_score(r["data_source"], r["extra_info"]["answer"], r["reward_model"]["ground_truth"]) == 1
               for r in rows)
    assert len(read_rows(str(out / "test.parquet"))) == 2


def test_preprocess_math_from_jsonl(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    records = [{"problem": "Half of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
                "type": "Algebra"},
               {"problem": "No boxed answer", "solution": "42", "level": "Level 2", "type": "Algebra"},
               {"problem": "MATH-500 style", "solution": "...", "answer": "3"}]
    (raw / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    proc = run_script("preprocess_math.py", "--local_dir", str(raw), "--output_dir", str(out), "--splits", "test")
    assert proc.returncode == 0, proc.stderr
    assert "1 without a boxed answer skipped" in proc.stdout
    rows = read_rows(str(out / "test.parquet"))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{1}{2}", "3"]
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[0]["extra_info"]["level"] == "Level 1" and rows[1]["extra_info"]["index"] == 2
    assert compute_score(rows[0]["data_source"], records[0]["solution"], rows[0]["reward_model"]["ground_truth"]) == 1


def test_preprocess_respects_hf_hub_offline(tmp_path):
    proc = run_script("preprocess_gsm8k.py", "--output_dir", str(tmp_path), env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0 and "HF_HUB_OFFLINE is set: pass --local_dir" in proc.stderr
    proc = run_script("preprocess_math.py", "--local_dir", str(tmp_path), "--output_dir", str(tmp_path))
    assert proc.returncode != 0 and "no train files" in proc.stderr
