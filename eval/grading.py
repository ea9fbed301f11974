"""Answer extraction and grading for the eval harness: MATH-style answers, GPQA letters, LiveCodeBench code.

Math (MATH500, AIME, HMMT)
    `extract_math_answer` takes what a model's output commits to: the content of the last `\\boxed{...}`
    (or `\\fbox{...}`, or `\\boxed X`), else the text after the last "the answer is" / "final answer is" /
    "Final Answer:" / a line starting "Answer:". A text with none of these has no answer (None): unlike
    Qwen2.5-Math's `extract_answer` (`evaluation/parser.py`, which falls back to the last number in the
    text by default), this module never guesses a number. The paper's harness (Random-Attention,
    `kvcompress/harness/Utils/parser.py`) reads the last box only, with no fallback at all; it also
    reads the content of a box left open by a truncated output, which this does not (None).

    `math_equal` compares with math-verify: both sides are written as `\\boxed{...}` and parsed by its LaTeX
    extractor, then `verify(gold, predicted)` decides (numeric within 6 decimals, symbolic equality, sets,
    intervals, tuples, matrices, equations). A bare string is not a good input to math-verify: without
    math delimiters it looks for an expression inside prose and may keep only a stray number (bare
    `1,-2` parses as 1, so a bare `1` would "equal" it; bare `(3,4]` or `\\text{Evelyn}` parse as
    nothing), so the wrapping is not optional. `$...$` parsed the 500 MATH500 golds to the same objects
    as `\\boxed{...}` when this was written; `\\boxed{}` is used because the content may itself hold a `$`
    (`\\$18.90` is fine, a stray `$` is not) and because it is the form a model's answer has. Every
    MATH500 gold parses to a sympy object under it, none to a bare string (tests/test_grading.py).

    The paper graded with a Qwen-Math-style `math_equal` (string normalisation + sympy), not math-verify,
    so the two can disagree on a few answers: `GRADER` names the grader, its version and this module's
    extraction rules, to be stored in each run's configuration.

GPQA
    `extract_choice` finds the chosen letter A-D (`\\boxed{C}`, "the answer is (C)", "Answer: C", ...; the
    last one in the text wins) and `choice_equal` compares letters.

LiveCodeBench
    `extract_code` takes the last fenced code block tagged python (or untagged), as LiveCodeBench's own
    extraction takes the last fenced block. Running the code is done elsewhere.

Timeouts
    math-verify bounds each parse and each comparison with `signal.alarm`, which only works in the main
    thread of the main interpreter (elsewhere it raises). `math_equal` uses those timeouts when called
    from the main thread and turns them off elsewhere: off the main thread a pathological answer
    (`9^{9^{9}}`, deeply nested fractions) can then take as long as sympy takes. To grade in parallel,
    use processes (each grades in its own main thread), not threads. In the main thread, math-verify
    swaps in its own SIGALRM handler for each parse/comparison (restoring the caller's after) and cancels
    any alarm the caller had pending: do not combine `math_equal` with your own `signal.alarm`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import threading

__all__ = [
    "EXTRACTION_VERSION",
    "GRADER",
    "MAX_ANSWER_CHARS",
    "TIMEOUT_SECONDS",
    "choice_equal",
    "extract_boxed",
    "extract_choice",
    "extract_code",
    "extract_math_answer",
    "grade",
    "math_equal",
]

EXTRACTION_VERSION = "boxed-last>answer-phrases;no-last-number;wrap-boxed;v1"
"""This module's extraction and wrapping rules; change it whenever they change (it is recorded per run)."""

TIMEOUT_SECONDS = 5
"""math-verify's limit for one parse and for one comparison (its own default), in whole seconds."""

MAX_ANSWER_CHARS = 1000
"""Longer extracted answers are rejected without parsing: no MATH/AIME/HMMT answer comes near it, and
sympy can spend its whole timeout on each of them (a degenerate output repeating one token)."""


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


GRADER = {
    "name": "math-verify",
    "version": _version("math-verify"),
    "latex2sympy2_extended": _version("latex2sympy2_extended"),
    "extraction": EXTRACTION_VERSION,
    "max_answer_chars": MAX_ANSWER_CHARS,
}
"""What graded the math answers, for each run's configuration (a paper run used Qwen-Math's math_equal)."""


# --------------------------------------------------------------------------------------------------- boxes

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced(text: str, start: int) -> str | None:
    """The content of the brace group opening at text[start] ('{'), or None if it never closes.

    `\\{` and `\\}` are escaped characters, not group braces (and `\\\\` is an escaped backslash).
    """
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def extract_boxed(text: str | None) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` in text (nested braces kept), else None.

    `\\boxed 5` (a space, then one token running to whitespace or `$`) is read as `5`. None when there is
    no box, or when the last one never closes (a truncated output: no committed answer). `\\boxed{}` gives "".
    """
    if not isinstance(text, str):
        return None
    last = None
    for last in _BOX.finditer(text):
        pass
    return None if last is None else _box_content(text, last.end())


def _box_content(text: str, after: int) -> str | None:
    """The argument of the box command ending at text[after]: a brace group or one token, else None."""
    start = len(text) - len(text[after:].lstrip())
    if start < len(text) and text[start] == "{":
        return _braced(text, start)
    if start == after:  # `\boxedX`, `\boxed` at the very end: no argument
        return None
    token = re.match(r"[^\s$]+", text[start:])
    return token.group(0) if token else None


# ------------------------------------------------------------------------------------------ math answers

# "the final answer is", "Final Answer:", "**Final Answer**:", "the answer is", a line starting "Answer:".
_ANSWER_PHRASE = re.compile(
    r"\bfinal\s+answer\b(?:\s*\**\s*(?:is\b|:))?"
    r"|\bthe\s+answer\s+is\b"
    r"|^[ \t>*#]*answer\s*\**\s*:",
    re.IGNORECASE | re.MULTILINE,
)
_MATH_SPANS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))


def _closing(text: str, closing: str, start: int) -> int | None:
    """Index of the first `closing` delimiter from start that is not escaped (`\\$` is a dollar sign)."""
    while (end := text.find(closing, start)) != -1:
        backslashes = len(text[:end]) - len(text[:end].rstrip("\\"))
        if closing.startswith("\\") or backslashes % 2 == 0:
            return end
        start = end + 1
    return None


def _after_phrase(rest: str) -> str:
    """The answer written after an answer phrase: a leading math span, else the rest of its sentence."""
    rest = rest.lstrip(" \t*:").lstrip()
    for opening, closing in _MATH_SPANS:
        if rest.startswith(opening):
            end = _closing(rest, closing, len(opening))
            if end is not None:
                return rest[len(opening) : end]
            break
    line = rest.split("\n", 1)[0]
    sentence_end = re.search(r"\.(?:\s|$)", line)  # "... is 42. Let me check": not "3.5"
    return line[: sentence_end.start()] if sentence_end else line


# A trailing unit written as text: "5.4 \text{ cents}", "15\mbox{ cm}^2" (only after something with a digit).
_TRAILING_UNIT = re.compile(r"\s*\\(?:text|mbox|textrm)\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?[23]\}?)?\s*$")


def _clean(answer: str | None) -> str | None:
    """Strip what surrounds a written answer: whitespace, a trailing period, `$`/`\\(`/`\\[` delimiters,
    markdown bold, a trailing text unit; "" becomes None. Idempotent."""
    if answer is None:
        return None
    previous = None
    while answer != previous:
        previous = answer
        answer = answer.strip().strip("*").strip()
        answer = answer.rstrip(".").rstrip()
        for opening, closing in _MATH_SPANS:
            if len(answer) >= len(opening) + len(closing) and answer.startswith(opening) and answer.endswith(closing):
                answer = answer[len(opening) : len(answer) - len(closing)]
                break
        unit = _TRAILING_UNIT.search(answer)
        if unit and re.search(r"\d", answer[: unit.start()]):
            answer = answer[: unit.start()]
    return answer or None


def extract_math_answer(text: str | None) -> str | None:
    """The final answer a model's output commits to, as written (LaTeX), or None.

    1. If the text has a `\\boxed`/`\\fbox`, the last one decides (None if it is empty or never closes).
    2. Otherwise the last "final answer is" / "Final Answer:" / "the answer is" / line-leading "Answer:",
       followed by a math span (`$...$`, `\\(...\\)`, `\\[...\\]`) or the rest of the sentence.
    3. Otherwise None: no guessing of a last number.
    The result is `_clean`ed: no trailing period, no surrounding `$`, no trailing `\\text{ unit}`.
    """
    if not isinstance(text, str) or not text:
        return None
    if _BOX.search(text):
        return _clean(extract_boxed(text))
    last = None
    for last in _ANSWER_PHRASE.finditer(text):
        pass
    if last is None:
        return None
    return _clean(_after_phrase(text[last.end() :]))


# Normalisations math-verify lacks: "90°" / "90\degree" (it reads "90^\circ"), "10\,080" (thin-space groups).
_DEGREE = re.compile(r"\s*(?:°|\\degree(?![A-Za-z])|\^\{?\\degree\}?)")
_THIN_SPACE_GROUP = re.compile(r"(?<=\d)\\[,;:!](?=\d{3}(?!\d))")


def _normalise(answer: str) -> str:
    answer = _clean(answer) or ""
    answer = _DEGREE.sub(r"^\\circ", answer)
    return _THIN_SPACE_GROUP.sub("", answer)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=8192)
def _parse(answer: str, timeout_seconds: int | None) -> tuple:
    """math-verify's parse of `\\boxed{answer}` (a sympy object and the matched string, or ())."""
    from math_verify import LatexExtractionConfig, parse

    return tuple(
        parse(
            "\\boxed{" + answer + "}",
            extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
            parsing_timeout=timeout_seconds,
        )
    )


def math_equal(predicted: str | None, gold: str, *, timeout_seconds: int | None = TIMEOUT_SECONDS) -> bool:
    """Whether an extracted answer equals the gold answer, by math-verify; never raises on bad input.

    Both sides get `_normalise`d and written as `\\boxed{...}` for math-verify's LaTeX parser, then
    `verify(gold, predicted)` (order matters to math-verify: the gold side may be an assignment `x=5`).
    None, "", an answer over `MAX_ANSWER_CHARS`, or one that does not parse (or whose parse or comparison
    times out) is not equal. `timeout_seconds` applies to each parse and each comparison, from the main
    thread only (see the module docstring); None disables it. A missing math-verify raises ImportError.
    """
    if not isinstance(predicted, str) or gold is None:
        return False
    predicted, gold = _normalise(predicted), _normalise(str(gold))
    if not predicted or not gold or len(predicted) > MAX_ANSWER_CHARS:
        return False
    from math_verify import verify
    from math_verify.errors import TimeoutException

    timeout = timeout_seconds if _in_main_thread() else None
    try:
        gold_parsed, predicted_parsed = _parse(gold, timeout), _parse(predicted, timeout)
        if not gold_parsed or not predicted_parsed:
            return False
        return bool(verify(list(gold_parsed), list(predicted_parsed), timeout_seconds=timeout))
    except (Exception, TimeoutException):  # math-verify catches its own; this is the last guard
        return False


# ------------------------------------------------------------------------------------------------ GPQA

# A box holding a choice: "C", "(c)", "\text{C}", "C) 42", "C. 42" (not "a+b").
_LETTER_IN_BOX = re.compile(
    r"^\s*(?:\\(?:text|textbf|mathrm|mathbf)\s*\{\s*)?"
    r"(?:\(\s*([A-Da-d])\s*\)|([A-Da-d])\s*(?:[).:}]|$))"
)
# "answer is (C)", "Answer: C", "**Answer:** C", "the correct option is C", "choice: $\text{(B)}$";
# "is" or a colon is required, so "Option A: 42" (restating the options) is not a choice.
_CHOICE_PHRASE = re.compile(
    r"(?i:\b(?:answer|choice|option)(?:\s+is\s*[:：]?|\s*\**\s*[:：]))[\s*$]*"
    r"(?:\\(?:text|textbf|mathrm|mathbf)\s*\{\s*)?"
    r"(?:\(\s*([A-Da-d])\s*\)|([A-D])(?![A-Za-z0-9]))"
)


def extract_choice(text: str | None) -> str | None:
    """The letter (A-D, upper case) a GPQA answer chooses, or None; the last statement in the text wins.

    Read from boxes (`\\boxed{C}`, `\\boxed{(c)}`, `\\boxed{\\text{C}}`, `\\boxed{C) 42}`) and from phrases
    ("the answer is (C)", "Answer: C", "**Answer:** C", "the correct option is C"). A bare lower-case
    letter after a phrase is not read ("the answer is a bit..."), in parentheses it is.
    """
    if not isinstance(text, str):
        return None
    found: list[tuple[int, str]] = []
    for box in _BOX.finditer(text):
        content = _box_content(text, box.end())
        letter = _LETTER_IN_BOX.match(content) if content else None
        if letter:
            found.append((box.start(), (letter.group(1) or letter.group(2)).upper()))
    for phrase in _CHOICE_PHRASE.finditer(text):
        found.append((phrase.start(), (phrase.group(1) or phrase.group(2)).upper()))
    return max(found)[1] if found else None


def choice_equal(predicted: str | None, gold_letter: str) -> bool:
    """Whether an extracted letter is the gold letter (case and parentheses ignored)."""
    if not isinstance(predicted, str) or not isinstance(gold_letter, str):
        return False
    predicted, gold_letter = predicted.strip().strip("()").upper(), gold_letter.strip().strip("()").upper()
    return len(gold_letter) == 1 and predicted == gold_letter


# ------------------------------------------------------------------------------------------------ code

_FENCE = re.compile(r"^\s*```\s*([\w+#.-]*)")
_PYTHON_TAGS = {"", "python", "python3", "py"}


def extract_code(text: str | None) -> str | None:
    """The last fenced code block tagged python/python3/py or untagged, or None if there is none.

    Fences are lines starting with ```; an opening fence is closed by the next fence line, and a block
    left open (a truncated output) is not code. LiveCodeBench's `extract_code` takes the lines between
    the last two lines containing ```, whatever their tags; this differs only on a later block in
    another language (```text, ```bash), which is skipped here, and on an unclosed last fence.
    """
    if not isinstance(text, str):
        return None
    lines = text.split("\n")
    code = None
    opened: tuple[int, str] | None = None
    for number, line in enumerate(lines):
        fence = _FENCE.match(line)
        if fence is None:
            continue
        if opened is None:
            opened = (number, fence.group(1).lower())
        else:
            if opened[1] in _PYTHON_TAGS:
                code = "\n".join(lines[opened[0] + 1 : number])
            opened = None
    return code


# ------------------------------------------------------------------------------------------------ grade


def grade(task: str, output: str | None, gold) -> tuple[str | None, bool | None]:
    """(extracted answer, correct) for one model output: task "math", "gpqa", or "code".

    Code is graded by running it elsewhere: for "code" this returns (extracted code, None).
    """
    if task == "math":
        extracted = extract_math_answer(output)
        return extracted, math_equal(extracted, None if gold is None else str(gold))
    if task == "gpqa":
        extracted = extract_choice(output)
        return extracted, choice_equal(extracted, gold)
    if task == "code":
        return extract_code(output), None
    raise ValueError(f"unknown task {task!r}: expected 'math', 'gpqa' or 'code'")
