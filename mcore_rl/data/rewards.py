"""Rule-based rewards, dispatched by a row's data_source (verl's names and scoring semantics).

    compute_score("openai/gsm8k", response_text, "72")            -> 1.0 / 0.0
    compute_score("DigitalLearningGmbH/MATH-lighteval", text, "\\frac{1}{2}")
"""

from __future__ import annotations

import re
from typing import Callable

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
TASK_PREFIX = "mcore_rl/"

# the final answer is at the end; scanning only the tail keeps regexes cheap on long outputs
_TAIL_CHARS = 300
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


# ----------------------------------------------------------------------------- GSM8K
def gsm8k_extract(text: str, method: str = "strict") -> str | None:
    """strict: the number after the last '#### ' (the format the prompt asks for);
    flexible: the last number anywhere. Commas (and '$' in strict) are dropped."""
    tail = text[-_TAIL_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method == "flexible":
        numbers = [n for n in _NUMBER.findall(tail) if n not in ("", ".")]
        return numbers[-1] if numbers else None
    raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")


def gsm8k_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> float:
    answer = gsm8k_extract(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


# ----------------------------------------------------------------------------- MATH
def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), nested braces balanced; also '\\boxed x'."""
    if "\\boxed " in text:  # "\boxed 5$" style: up to the closing dollar
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1:i]
    return None  # unbalanced: the answer was cut off


_MATH_DELETIONS = ("\n", "\\!", "\\left", "\\right", "^{\\circ}", "^\\circ", "\\$", "\\%")


def _braced_frac_and_sqrt(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{7} -> \frac{1}{7}, \sqrt3 -> \sqrt{3}
    s = re.sub(r"\\frac([^{\\])([^{\\])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac([^{\\])\{", r"\\frac{\1}{", s)
    return re.sub(r"\\sqrt([^{\\])", r"\\sqrt{\1}", s)


def normalize_math_answer(answer: str) -> str:
    """Canonical string for MATH answers (the Hendrycks MATH normalisation)."""
    s = answer.replace("\\\\", "\\").replace("tfrac", "frac").replace("dfrac", "frac")
    for junk in _MATH_DELETIONS:
        s = s.replace(junk, "")
    if s.count("\\text{ ") == 1:  # units written after the number
        s = s.split("\\text{ ")[0]
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs) <= 2:  # "x = 5" -> "5"
        s = rhs
    s = _braced_frac_and_sqrt(s.replace(" ", ""))
    if s == "0.5":
        return "\\frac{1}{2}"
    ratio = re.fullmatch(r"(-?\d+)/(-?\d+)", s)
    if ratio and all(str(int(g)) == g for g in ratio.groups()):
        return "\\frac{%s}{%s}" % ratio.groups()
    return s


def math_score(solution_str: str, ground_truth: str) -> float:
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    return float(normalize_math_answer(answer) == normalize_math_answer(ground_truth))


# ----------------------------------------------------------------------------- dispatch
def task_score(solution_str: str, ground_truth: str) -> float:
    """Embedded tasks (mcore_rl.data.tasks): the first response character must be the target."""
    return float(solution_str[:1] == ground_truth)


REWARD_FNS: dict[str, Callable[[str, str], float]] = {
    **{s: gsm8k_score for s in GSM8K_SOURCES}, **{s: math_score for s in MATH_SOURCES},
}


def register_reward(data_source: str, fn: Callable[[str, str], float]) -> None:
    """Add or replace the reward of a data_source: fn(solution_str, ground_truth) -> float."""
    REWARD_FNS[data_source] = fn


def reward_fn(data_source) -> Callable[[str, str], float] | None:
    """The reward of a data_source, None where it has none."""
    if not isinstance(data_source, str):
        return None
    return REWARD_FNS.get(data_source) or (task_score if data_source.startswith(TASK_PREFIX) else None)


def no_reward_message(data_source) -> str:
    return (f"no reward function for data_source {data_source!r}; known: {sorted(REWARD_FNS)} and "
            f"{TASK_PREFIX}<task>; see mcore_rl.data.rewards.register_reward")


def require_reward(data_source, where: str) -> None:
    """A training row's data_source must have a reward: checked before the run, not at its first score."""
    if reward_fn(data_source) is None:
        from mcore_rl.preflight.bad_input import BadInput

        raise BadInput(f"{where}: {no_reward_message(data_source)}")


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> float:
    fn = reward_fn(data_source)
    if fn is None:
        raise NotImplementedError(no_reward_message(data_source))
    return float(fn(solution_str, ground_truth))
