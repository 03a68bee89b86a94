"""benchmarks/harness.py, the code the benchmark scripts share: tables, JSON, timed calls, a child's
wall time and peak RSS."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import harness


def test_table_aligns_columns_and_formats_numbers():
    text = harness.table(["run", "step s", "err"], [("optimized", 1.8812, 1e-5), ("baseline", 14.2, None)])
    head, rule, *rows = text.splitlines()
    assert head.split() == ["run", "step", "s", "err"] and set(rule) == {"-"}
    assert rows[0].startswith("optimized") and rows[0].split()[1:] == ["1.881", "1.000e-05"]
    assert rows[1].split()[1:] == ["14.200", "-"]
    assert len({len(line) for line in text.splitlines()}) == 1  # one width: columns line up


def test_write_json_replaces_the_file_whole(tmp_path):
    path = str(tmp_path / "r.json")
    harness.write_json({"a": 1}, path)
    harness.write_json({"b": 2}, path)
    assert json.loads(open(path).read()) == {"b": 2} and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_timed_calls_skip_the_warm_up():
    calls = []
    times = harness.timed_calls(lambda: calls.append(1), iters=3, warmup=2)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)


def test_run_child_reports_wall_time_and_peak_rss():
    r = harness.run_child([sys.executable, "-c", "b = bytearray(200 << 20)"])
    assert r["wall_s"] > 0 and r["peak_rss_gib"] > 0.19
    with pytest.raises(SystemExit, match="exit code 3"):
        harness.run_child([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_an_engine_kind_with_dp_attention_is_the_loops_engine_arguments():
    """engine_bench.py speed --kinds bf16:tp_size=4+ep_size=4+dp_attention=true: the engine rollout.dp_attention
    starts (mcore_rl.rollout.sglang.dp_attention_args), refused below TP 2."""
    from benchmarks.engine_bench import parse_kind
    from mcore_rl.rollout.sglang import dp_attention_args

    assert parse_kind("bf16:tp_size=4+ep_size=4+dp_attention=true") == (
        "bf16", {"tp_size": 4, "ep_size": 4, **dp_attention_args(4)})
    assert dp_attention_args(4)["dp_size"] == 4 and dp_attention_args(1) == {}
    assert parse_kind("fp8:tp_size=4+dp_attention=false") == ("fp8", {"tp_size": 4})
    with pytest.raises(ValueError, match="dp_attention needs tp_size > 1"):
        parse_kind("bf16:dp_attention=true")
