"""The grader, through the same extraction a model's output goes through.

Every MATH500 gold answer, written as a model would write it, is accepted; so are equivalent rewrites
of them (generated over the golds, plus a hand list); near-misses (wrong numbers, signs, a missing or
extra root, swapped coordinates) are rejected; malformed answers are rejected without a crash. Then the
GPQA letter and LiveCodeBench code extraction.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import re
import signal
import threading
from fractions import Fraction
from pathlib import Path

import pytest

pytest.importorskip("math_verify", reason="the math grader needs the eval extra (math-verify)")

from randkv_jax.eval.grading import (
    GRADER,
    MAX_ANSWER_CHARS,
    choice_equal,
    extract_boxed,
    extract_choice,
    extract_code,
    extract_math_answer,
    grade,
    math_equal,
)

MATH500 = Path(__file__).resolve().parents[2] / "shared" / "data" / "math500.jsonl"

# Gold answers that math-verify cannot grade even as written, with the reason. Keep it empty if possible.
UNGRADABLE: dict[str, str] = {}


@pytest.fixture(scope="module")
def golds() -> list[str]:
    if not MATH500.exists():
        pytest.skip(f"MATH500 data not found at {MATH500} (the shared data checkout is absent)")
    answers = [json.loads(line)["answer"] for line in MATH500.read_text().splitlines() if line.strip()]
    assert len(answers) == 500
    return answers


def accepted(written: str, gold: str) -> bool:
    """Graded as a model's output would be: a sentence ending in the boxed answer."""
    return math_equal(extract_math_answer(f"Let me think... so the answer is \\boxed{{{written}}}."), gold)


# -------------------------------------------------------------------------------- gold answers themselves


def test_every_gold_is_accepted_as_a_model_writes_it(golds):
    phrasings = (
        "Let me think... so the answer is \\boxed{{{}}}.",
        "The final answer is $\\boxed{{{}}}$",
    )
    failed = []
    for gold in golds:
        if gold in UNGRADABLE:
            continue
        for phrasing in phrasings:
            output = phrasing.format(gold)
            extracted = extract_math_answer(output)
            if not math_equal(extracted, gold):
                failed.append((output, extracted, gold))
    assert not failed, f"{len(failed)} gold answers rejected: {failed[:10]}"


def test_every_gold_parses_to_a_math_object(golds):
    """Not to a string: math-verify compares strings only by equality, which would hide a bad parse."""
    from randkv_jax.eval.grading import _normalise, _parse
    from sympy import Basic
    from sympy.matrices import MatrixBase

    parsed = {gold: _parse(_normalise(gold), 5) for gold in golds}
    unparsed = [gold for gold, p in parsed.items() if not (p and isinstance(p[0], (Basic, MatrixBase)))]
    assert not unparsed


def test_gold_answers_in_fallback_phrasings(golds):
    """Without a box: 'The final answer is $gold$.' and 'Final Answer: gold' (a sample of 100)."""
    failed = []
    for gold in golds[::5]:
        for output in (f"The final answer is ${gold}$.", f"**Final Answer:** ${gold}$", f"Answer: {gold}"):
            if not math_equal(extract_math_answer(output), gold):
                failed.append((output, extract_math_answer(output)))
    assert not failed


# ---------------------------------------------------------------------------------- generated rewrites

FRACTION = re.compile(r"^(-?)\\[dt]?frac\s*\{?(\d+)\}?\s*\{?(\d+)\}?$")
INTEGER = re.compile(r"^-?\d+$")
DECIMAL = re.compile(r"^-?\d*\.\d+$")
DEGREES = re.compile(r"^(\d+)\^\\circ$")
BASE = re.compile(r"^(\d+)_\{?(\d+)\}?$")
TEXT = re.compile(r"^\\text\{([A-Za-z]+)\}$")
PLUS_MINUS = re.compile(r"^([^,]+?)\s*\\pm\s*([^,]+)$")
THOUSANDS = re.compile(r"^(?:\\\$)?\d{1,3}(?:,(?:\\!)?\s*\d{3})+$")


def split_top_level(text: str) -> list[str]:
    """Split at commas outside (), [], {} (and \\{ \\})."""
    parts, depth, current = [], 0, ""
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            depth += 1 if text[i + 1] == "{" else -1
            current += text[i : i + 2]
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += c
        i += 1
    parts.append(current.strip())
    return parts


def tuple_parts(gold: str) -> list[str] | None:
    """The coordinates of a gold written as a tuple `(a, b, ...)` / `\\left( a, b \\right)`, else None."""
    inner = re.fullmatch(r"\\left\(\s*(.*?)\s*\\right\)|\((.*)\)", gold)
    if not inner:
        return None
    body = inner.group(1) if inner.group(1) is not None else inner.group(2)
    depth = 0
    for c in body:  # "(0,9) \cup (9,36)" is not one tuple
        depth += (c in "([{") - (c in ")]}")
        if depth < 0:
            return None
    parts = split_top_level(body)
    return parts if len(parts) >= 2 and all(parts) else None


def root_list(gold: str) -> list[str] | None:
    """The members of a gold written as a list of roots `1,-2` / `\\{a, b\\}` (not `10,\\!080`), else None."""
    if THOUSANDS.match(gold):
        return None
    body = gold[2:-2] if gold.startswith("\\{") and gold.endswith("\\}") else gold
    parts = split_top_level(body)
    return parts if len(parts) >= 2 else None


def decimal_of(fraction: Fraction) -> str | None:
    """The exact decimal of a fraction whose denominator has only the factors 2 and 5, else None."""
    d = fraction.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d != 1:
        return None
    places = 0
    while (fraction * 10**places).denominator != 1:
        places += 1
    return f"{float(fraction):.{places}f}"


def rewrites(gold: str) -> list[str]:
    """Equivalent ways a model could write the gold answer."""
    out = []
    if m := FRACTION.match(gold):
        sign, a, b = m.groups()
        value = Fraction(int(a), int(b)) * (-1 if sign else 1)
        out += [f"{sign}\\dfrac{{{a}}}{{{b}}}", f"{sign}{a}/{b}", f"\\frac{{{sign}{a}}}{{{b}}}"]
        if (decimal := decimal_of(value)) is not None:
            out.append(decimal)
    elif "\\frac" in gold:
        out.append(gold.replace("\\frac", "\\dfrac"))
    if "\\dfrac" in gold:
        out.append(gold.replace("\\dfrac", "\\frac"))
    if INTEGER.match(gold):
        out += [f"{gold}.0", f"{gold}\\text{{ units}}"]
    if DECIMAL.match(gold):
        value = Fraction(gold if not gold.startswith(".") else "0" + gold)
        out.append(f"\\frac{{{value.numerator}}}{{{value.denominator}}}")
        if gold.startswith("."):
            out.append("0" + gold)
    if m := DEGREES.match(gold):
        n = m.group(1)
        out += [n, f"{n}^{{\\circ}}", f"{n}°", f"{n}\\text{{ degrees}}"]
    if m := BASE.match(gold):
        out.append(f"{m.group(1)}_{{{m.group(2)}}}")
    if m := TEXT.match(gold):
        out += [m.group(1), f"\\textbf{{{m.group(1)}}}"]
    if (parts := tuple_parts(gold)) is not None:
        if gold.startswith("\\left("):
            out.append("(" + ", ".join(parts) + ")")
        else:
            out.append("\\left( " + ", ".join(parts) + " \\right)")
    if (roots := root_list(gold)) is not None:
        out += [", ".join(reversed(roots)), "\\{" + ", ".join(roots) + "\\}"]
    if m := PLUS_MINUS.match(gold):
        a, b = m.group(1).strip(), m.group(2).strip()
        out.append(f"{a} + {b}, {a} - {b}")
    if "pmatrix" in gold:
        out.append(gold.replace("pmatrix", "bmatrix"))
    if re.search(r"\\sqrt\d", gold):
        out.append(re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", gold))
    if gold.startswith("\\$"):
        out.append(gold[2:])
    if "\\mbox{" in gold:
        out.append(re.sub(r"\s*\\mbox\{[^}]*\}(\^\d)?", "", gold))
    if re.search(r"\\text\{ [a-z]+\}$", gold):
        out.append(re.sub(r"\s*\\text\{ [a-z]+\}$", "", gold))
    return [r for r in out if r != gold]


def near_misses(gold: str) -> list[str]:
    """Answers a careless model could give that are not the gold answer."""
    out = []
    if INTEGER.match(gold):
        out.append(str(int(gold) + 1))
        if int(gold) != 0:
            out.append(str(-int(gold)))
    if m := FRACTION.match(gold):
        sign, a, b = m.groups()
        out.append(f"{sign}\\frac{{{int(a) + 1}}}{{{b}}}")
        out.append(f"\\frac{{{a}}}{{{b}}}" if sign else f"-\\frac{{{a}}}{{{b}}}")
    if DECIMAL.match(gold):
        value = Fraction(gold if not gold.startswith(".") else "0" + gold)
        out += [str(float(value + 1)), str(float(-value))]
    if m := DEGREES.match(gold):
        out.append(f"{int(m.group(1)) + 1}^\\circ")
    if m := BASE.match(gold):
        digits, base = m.group(1), int(m.group(2))
        out.append(f"{digits[:-1]}{(int(digits[-1]) + 1) % base}_{base}")
    if (parts := tuple_parts(gold)) is not None:
        if parts[0] != parts[1]:
            out.append("(" + ", ".join([parts[1], parts[0], *parts[2:]]) + ")")
        first = parts[0][1:] if parts[0].startswith("-") else "-" + parts[0]
        if parts[0] != "0":
            out.append("(" + ", ".join([first, *parts[1:]]) + ")")
    if (roots := root_list(gold)) is not None:
        out += [", ".join(roots[:-1]), ", ".join([*roots, "1000"])]
        first = roots[0][1:] if roots[0].startswith("-") else "-" + roots[0]
        out.append(", ".join([first, *roots[1:]]))
    if m := PLUS_MINUS.match(gold):
        out.append(f"{m.group(1).strip()} + {m.group(2).strip()}")
    if "pmatrix" in gold:
        entries = re.search(r"\\begin\{pmatrix\}\s*(-?)", gold)
        out.append(gold[: entries.start(1)] + ("" if entries.group(1) else "-") + gold[entries.end(1) :])
    symbolic = (  # an expression (not a number, set, tuple, equation, text): negate it
        not FRACTION.match(gold)
        and re.search(r"[a-zA-Z]", gold)
        and not re.search(r"\\text|\\mbox|\\begin|\\\$|=|,|\\in|\\cup|\\pm|_|\\circ", gold)
    )
    if symbolic and tuple_parts(gold) is None and not re.fullmatch(r"[(\[].*[)\]]", gold):
        out.append(f"-({gold})")
    return [m for m in out if m != gold]


def test_generated_rewrites_are_accepted(golds):
    cases = [(r, gold) for gold in golds for r in rewrites(gold)]
    assert len(cases) > 250  # the generators above do match the data
    rejected = [(r, gold) for r, gold in cases if not accepted(r, gold)]
    assert not rejected, f"{len(rejected)} of {len(cases)} rewrites rejected: {rejected[:20]}"


def test_generated_near_misses_are_rejected(golds):
    cases = [(m, gold) for gold in golds for m in near_misses(gold)]
    assert len(cases) > 500
    kinds = {"tuple swap": 0, "root list": 0}
    for gold in golds:
        kinds["tuple swap"] += tuple_parts(gold) is not None
        kinds["root list"] += root_list(gold) is not None
    assert kinds["tuple swap"] >= 10 and kinds["root list"] >= 4, kinds
    wrongly = [(m, gold) for m, gold in cases if accepted(m, gold)]
    assert not wrongly, f"{len(wrongly)} of {len(cases)} near-misses accepted: {wrongly[:20]}"


# ---------------------------------------------------------------------------------------- hand lists

VECTOR = "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}"  # a MATH500 gold

HAND_REWRITES = [  # (written, gold): equivalent
    ("0.5", "\\frac12"),
    ("\\frac{1}{2}", "\\frac12"),
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\tfrac12", "\\frac{1}{2}"),
    ("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\left(3,\\dfrac{\\pi}{2}\\right)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\text{evelyn}", "\\text{Evelyn}"),
    ("Evelyn", "\\text{Evelyn}"),
    ("90", "90^\\circ"),
    ("90 degrees", "90^\\circ"),
    ("90\\degree", "90^\\circ"),
    ("-2, 1", "1,-2"),
    ("x=1, x=-2", "1,-2"),
    ("x = 1 \\text{ or } x = -2", "1,-2"),
    ("\\{-2, 1\\}", "1,-2"),
    ("x=5", "x=5"),
    ("5", "x=5"),
    ("C", "\\text{(C)}"),
    ("(C)", "\\text{(C)}"),
    ("10080", "10,\\!080"),
    ("10,080", "10,\\!080"),
    ("10\\,080", "10,\\!080"),
    ("11111111100", "11,\\! 111,\\! 111,\\! 100"),
    ("\\$32348", "\\$32,\\!348"),
    ("864 \\text{ square inches}", "864 \\mbox{ inches}^2"),
    ("5.40", "5.4 \\text{ cents}"),
    ("\\frac{270}{7}^\\circ", "\\frac{270}7\\text{ degrees}"),
    ("1.8", "1\\frac{4}{5}"),
    ("\\frac{9}{5}", "1\\frac{4}{5}"),
    ("275/2", "137 \\frac{1}{2}"),
    ("137.5", "137 \\frac{1}{2}"),
    ("[-2,7]", "x \\in [-2,7]"),
    ("\\begin{pmatrix} -\\frac13 \\\\ \\frac23 \\\\ \\frac53 \\end{pmatrix}", VECTOR),
    ("1+\\sqrt{19}, 1-\\sqrt{19}", "1 \\pm \\sqrt{19}"),
    ("-2, 1\\pm\\sqrt5", "\\{1\\pm\\sqrt{5},-2\\}"),
    ("y=2x+3", "y = 2x + 3"),
    ("2x+3", "y = 2x + 3"),
    ("-q+p", "p - q"),
    ("3r^2", "3R^2"),
    ("\\sqrt2 \\cdot 11", "11\\sqrt2"),
    ("6.72\\times 10^{-5}", ".0000672"),
    ("\\frac{\\cos x}{\\sin x}", "\\cot x"),
    ("ab+2a+5b+10", "(a+5)(b+2)"),
    ("(b+2)(a+5)", "(a+5)(b+2)"),
    ("-5x+7y-11z-4=0", "5x - 7y + 11z + 4 = 0"),
    ("10x-14y+22z+8=0", "5x - 7y + 11z + 4 = 0"),
    ("\\frac{1}{\\sqrt2}", "\\frac{\\sqrt{2}}{2}"),
    ("\\sqrt{3}/3", "\\frac{\\sqrt{3}}{3}"),
    ("(-\\infty,2)\\cup(3,\\infty)", "(-\\infty, 2) \\cup (3, \\infty)"),
    ("\\left[\\frac{\\pi^2}{8},\\frac{5\\pi^2}{4}\\right]", "\\left[ \\frac{\\pi^2}{8}, \\frac{5 \\pi^2}{4} \\right]"),
    ("0.333333", "\\frac{1}{3}"),
    ("50\\%", "50"),
    ("2516_{8}", "2516_8"),
    ("6-5i", "6 - 5i"),
]

HAND_NEAR_MISSES = [  # (written, gold): not equivalent
    ("(\\frac{\\pi}{2}, 3)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("(3, \\pi)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\text{Navin}", "\\text{Evelyn}"),
    ("91", "90^\\circ"),
    ("\\frac{\\pi}{2}", "90^\\circ"),
    ("1", "1,-2"),
    ("1, 2", "1,-2"),
    ("1, -2, 3", "1,-2"),
    ("(1,-2)", "(-2,1)"),
    ("[-2,1]", "(-2,1)"),
    ("(-29,15)", "(15,-29)"),
    ("53_8", "52_8"),
    ("y=5", "x=5"),
    ("D", "\\text{(C)}"),
    ("[-2,6]", "x \\in [-2,7]"),
    ("\\begin{pmatrix} 1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}", VECTOR),
    ("\\begin{pmatrix} 2/3 \\\\ -1/3 \\\\ 5/3 \\end{pmatrix}", VECTOR),
    ("1+\\sqrt{19}", "1 \\pm \\sqrt{19}"),
    ("1+\\sqrt5, 1-\\sqrt5", "\\{1\\pm\\sqrt{5},-2\\}"),
    ("y=2x-3", "y = 2x + 3"),
    ("q-p", "p - q"),
    ("11\\sqrt{3}", "11\\sqrt2"),
    ("6+5i", "6 - 5i"),
    ("\\tan x", "\\cot x"),
    ("\\text{parabola}", "\\text{ellipse}"),
    ("\\text{odd}", "\\text{even}"),
    ("west", "\\text{east}"),
    ("(-\\infty,2]\\cup(3,\\infty)", "(-\\infty, 2) \\cup (3, \\infty)"),
    ("(0,36)", "(0,9) \\cup (9,36)"),
    ("(3,4)", "(3,4]"),
    ("[3,4]", "(3,4]"),
    ("(a+2)(b+5)", "(a+5)(b+2)"),
    ("5x-7y+11z-4=0", "5x - 7y + 11z + 4 = 0"),
    ("x^5-x^4+x^3-x^2+x+1", "x^5 - x^4 + x^3 - x^2 + x - 1"),
    ("0.33", "\\frac{1}{3}"),
    ("-\\infty", "\\infty"),
    ("2517_8", "2516_8"),
    ("137", "137 \\frac{1}{2}"),
    ("\\frac{1}{2}", "-\\frac{1}{2}"),
    ("14", "\\frac{14}{3}"),
    ("3", "\\frac{14}{3}"),
]


@pytest.mark.parametrize("written, gold", HAND_REWRITES)
def test_hand_rewrites_are_accepted(written, gold):
    assert accepted(written, gold)


@pytest.mark.parametrize("written, gold", HAND_NEAR_MISSES)
def test_hand_near_misses_are_rejected(written, gold):
    assert not accepted(written, gold)


# ------------------------------------------------------------------------------------------ malformed

MALFORMED_OUTPUTS = [
    "\\boxed{",
    "so the answer is \\boxed{5",
    "\\boxed{}",
    "\\boxed{ }",
    "\\boxed{\\frac{1}{2}",
    "the answer is \\boxed{}}}",
    "\\boxed{}{}{",
    "\\boxed",
    "\\fbox{",
    "The answer is",
    "The answer is $",
    "Final Answer:",
    "",
    "}{",
    "\\boxed{\\frac{}{}}",
    "\\boxed{\\sqrt{}}",
    "\\boxed{\\begin{pmatrix} 1 \\\\ 2}",
    "\\boxed{((((((}",
    "\\boxed{$$$}",
    "\\boxed{\\\\\\\\}",
    "\\boxed{\x00\x01\x02}",
    "\\boxed{" + "x" * (MAX_ANSWER_CHARS + 1) + "}",
]


@pytest.mark.parametrize("output", MALFORMED_OUTPUTS)
def test_malformed_outputs_are_rejected_without_a_crash(output):
    extracted = extract_math_answer(output)
    assert not math_equal(extracted, "5")
    assert not math_equal(extracted, "\\frac{1}{2}")
    grade("math", output, "5")


def test_random_bytes_and_none_are_rejected():
    rng = random.Random(0)
    for _ in range(50):
        text = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80))).decode("latin-1")
        for output in (text, f"\\boxed{{{text}}}", f"the answer is {text}"):
            assert not math_equal(extract_math_answer(output), "5")
            assert not math_equal(output, "5")
    assert extract_math_answer(None) is None
    assert extract_boxed(None) is None
    assert not math_equal(None, "5")
    assert not math_equal("5", None)
    assert not math_equal(5, "5")  # not a string
    assert grade("math", None, "5") == (None, False)


def test_huge_expressions_are_bounded_by_the_timeout():
    """Deep nesting or astronomically large numbers end in a timeout (False), and leave no alarm behind."""
    handler = signal.getsignal(signal.SIGALRM)
    huge = [
        "\\frac{" * 40 + "1" + "}{2}" * 40,
        "(" * 1500 + "1" + ")" * 1500,
        "9^{9^{9^{9}}}",
        "\\sqrt{" * 300 + "2" + "}" * 300,
    ]
    for expression in huge:
        assert not math_equal(expression, "5", timeout_seconds=1)
    assert signal.alarm(0) == 0  # nothing pending
    assert signal.getsignal(signal.SIGALRM) is handler


def test_off_the_main_thread_it_grades_without_the_signal_timeout():
    results = []

    def work():
        results.append((math_equal("0.5", "\\frac{1}{2}"), math_equal("0.6", "\\frac{1}{2}")))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert results == [(True, False)]


# ---------------------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{5}", "5"),
        ("first \\boxed{3} then \\boxed{4}", "4"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{\\left\\{ x \\right.}", "\\left\\{ x \\right."),
        ("\\fbox{7}", "7"),
        ("\\boxed{1} and then \\fbox{2}", "2"),
        ("$\\boxed 5$", "5"),
        ("\\boxed  12.", "12."),
        ("\\boxed {6}", "6"),
        ("\\boxed{\\boxed{8}}", "8"),
        ("\\boxed{}", ""),
        ("\\boxed{3} but then \\boxed{4", None),
        ("\\boxedfoo{3}", None),
        ("no box here", None),
        ("\\boxed", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{5}.", "5"),
        ("$\\boxed{\\$18.90}$", "\\$18.90"),
        ("The answer is $\\frac{3}{4}$.", "\\frac{3}{4}"),
        ("The answer is 42. Let me double-check.", "42"),
        ("the answer is 3.5.", "3.5"),
        ("The final answer is $\\$36$. I hope it is correct.", "\\$36"),
        ("Final Answer: 7", "7"),
        ("**Final Answer**\n\n\\[\n\\boxed{9}\n\\]", "9"),
        ("**Final Answer:** $x = 2$", "x = 2"),
        ("**Final Answer**: $(1, 2)$", "(1, 2)"),
        ("Therefore, the final answer is: $\\frac12$", "\\frac12"),
        ("Work...\nAnswer: 15", "15"),
        ("The answer is\n$$\n12\n$$", "12"),
        ("The answer is \\(\\sqrt{2}\\)", "\\sqrt{2}"),
        ("the answer is 7, then the answer is 8.", "8"),
        ("so the answer is \\boxed{5.4 \\text{ cents}}", "5.4"),
        ("so the answer is \\boxed{15\\mbox{ cm}^2}", "15"),
        ("so the answer is \\boxed{\\text{Evelyn}}", "\\text{Evelyn}"),
        ("so the answer is \\boxed{\\text{(C)}}", "\\text{(C)}"),
        ("the answer is \\boxed{} sorry", None),
        ("We get 2 + 3 = 5 apples in total.", None),
        ("the answer is \\boxed{5", None),
        ("", None),
    ],
)
def test_extract_math_answer(text, expected):
    assert extract_math_answer(text) == expected


def test_grader_record():
    assert GRADER["name"] == "math-verify"
    assert GRADER["version"] == importlib.metadata.version("math-verify")
    assert isinstance(GRADER["extraction"], str) and GRADER["extraction"]
    assert json.loads(json.dumps(GRADER)) == GRADER  # it goes into the run's configuration


def test_grade_dispatch():
    assert grade("math", "so \\boxed{\\frac{1}{2}}", "0.5") == ("\\frac{1}{2}", True)
    assert grade("math", "so \\boxed{3}", 4) == ("3", False)
    assert grade("math", "The answer is 204.", 204) == ("204", True)
    assert grade("gpqa", "The answer is (B).", "B") == ("B", True)
    assert grade("gpqa", "The answer is (B).", "C") == ("B", False)
    assert grade("code", "```python\nprint(1)\n```", None) == ("print(1)", None)
    with pytest.raises(ValueError):
        grade("poetry", "", None)


# -------------------------------------------------------------------------------------------- GPQA


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is (C).", "C"),
        ("the answer is C", "C"),
        ("Answer: B", "B"),
        ("ANSWER: D", "D"),
        ("**Answer:** A", "A"),
        ("**Answer**: (d)", "D"),
        ("The correct option is B.", "B"),
        ("The correct answer is: $\\text{(A)}$", "A"),
        ("Thus $\\boxed{C}$", "C"),
        ("\\boxed{(b)}", "B"),
        ("\\boxed{\\text{D}}", "D"),
        ("\\boxed{A) 42 kJ}", "A"),
        ("The answer is (A). Wait, no: the answer is (D).", "D"),
        ("Answer: B\n...on reflection \\boxed{C}", "C"),
        ("\\boxed{C} ... so Answer: A", "A"),
        ("Option A: 42\nOption B: 43", None),
        ("the answer is a bit unclear", None),
        ("the answer is Always positive", None),
        ("\\boxed{a+b}", None),
        ("\\boxed{E}", None),
        ("no letter at all", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_choice(text, expected):
    assert extract_choice(text) == expected


def test_choice_equal():
    assert choice_equal("C", "C")
    assert choice_equal("c", "(C)")
    assert not choice_equal("B", "C")
    assert not choice_equal(None, "C")
    assert not choice_equal("", "C")
    assert not choice_equal("CD", "C")


# -------------------------------------------------------------------------------------------- code


@pytest.mark.parametrize(
    "text, expected",
    [
        ("```python\nprint(1)\n```", "print(1)"),
        ("```\nx = 2\n```", "x = 2"),
        ("draft:\n```python\nold()\n```\nfinal:\n```python\nnew()\nmore()\n```\ndone", "new()\nmore()"),
        ("```python\ncode()\n```\nExample:\n```text\n3 4\n```", "code()"),
        ("```py\na = 1\n```", "a = 1"),
        ("```python\nfirst()\n```\n```python\ntruncated(", "first()"),
        ("```python\n```", ""),
        ("no code here", None),
        ("```python\nnever closed", None),
        ("```cpp\nint main() {}\n```", None),
        (None, None),
    ],
)
def test_extract_code(text, expected):
    assert extract_code(text) == expected
