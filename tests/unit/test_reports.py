"""Measurements live in docs/performance.md (and the JSON records), not in config descriptions or the
other docs; benchmarks/ holds the benchmarks and their shared code only."""

from __future__ import annotations

import glob
import os
import re

from mcore_rl.config.sections import schema

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORDINAL = r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\d+(st|nd|rd|th))"
PASS_LABEL = re.compile(rf"\b{ORDINAL}( real-width)? pass(es)?\b|\bpasses\)", re.IGNORECASE)
GPU_FIGURE = re.compile(r"\b[HB]\d00\b.*\d")  # a GPU named beside a number: a measurement


def _docs() -> dict[str, str]:
    return {os.path.relpath(p, ROOT): open(p).read() for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
            if not p.endswith("performance.md")}


def test_no_pass_label_or_measured_figure_in_config_descriptions():
    text = schema()
    assert not PASS_LABEL.search(text) and "RESULTS.md" not in text
    assert not [line for line in text.splitlines() if GPU_FIGURE.search(line)]


def test_no_pass_label_or_notebook_reference_in_docs():
    found = {path: m.group(0) for path, text in _docs().items()
             for m in [PASS_LABEL.search(text) or re.search(r"RESULTS\.md", text)] if m}
    assert found == {}


def test_benchmarks_folder_holds_at_most_six_files():
    files = [f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if os.path.isfile(os.path.join(ROOT, "benchmarks", f))]
    assert len(files) <= 6, sorted(files)
    # every benchmark docs/performance.md reports on exists
    named = set(re.findall(r"`(benchmarks/\w+\.py|tests/gpu/\w+\.py|scripts/\w+\.py)`",
                           open(os.path.join(ROOT, "docs", "performance.md")).read()))
    assert named and all(os.path.exists(os.path.join(ROOT, p)) for p in named), named
