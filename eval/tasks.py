"""The paper's evaluation protocol as data: per-task presets, per-model sampling, prompts.

Presets (`../shared/reference/algorithms.md` §1.4 and §7, `scripts/run_cell.sh`): the cache budget
T and the samples per problem of each task, generation capped at 32,768 tokens, r = 64.
Sampling per model family: Qwen3 temperature 0.6, top-p 0.95, top-k off (the paper's harness
takes temperature and top-p from the generation config and sets no top-k, although Qwen3's
generation config says top-k 20); Phi-4-reasoning 0.8 / 0.95. Other architectures get the Qwen3
setting unless told otherwise.
"""

from __future__ import annotations

import dataclasses

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
GPQA_INSTRUCTION = ("Please reason step by step, and put your final answer (the letter of the correct choice) "
                    "within \\boxed{}.")
MAX_NEW_TOKENS = 32768


@dataclasses.dataclass(frozen=True)
class Preset:
    budget: int
    """The cache budget T (entries per KV head after a round, prompt and window included)."""
    samples: int
    """Samples per problem."""
    max_new_tokens: int = MAX_NEW_TOKENS


PRESETS = {
    "math500": Preset(budget=1024, samples=2),
    "gpqa-diamond": Preset(budget=2048, samples=4),
    "aime2025": Preset(budget=4096, samples=16),
    "aime2026": Preset(budget=4096, samples=16),
    "hmmt-feb-2025": Preset(budget=4096, samples=16),
    "livecodebench": Preset(budget=3072, samples=4),
}
"""By dataset name (`randkv_jax.eval.datasets.DATASETS`)."""

TASK_PRESETS = {"math": PRESETS["math500"], "gpqa": PRESETS["gpqa-diamond"], "code": PRESETS["livecodebench"]}
"""For a dataset given by path only: by task."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int = 0


SAMPLING = {
    "Qwen3ForCausalLM": Sampling(0.6, 0.95),
    "Phi3ForCausalLM": Sampling(0.8, 0.95),  # Phi-4-reasoning
}
DEFAULT_SAMPLING = SAMPLING["Qwen3ForCausalLM"]


def preset_for(dataset_name: str, task: str) -> Preset:
    return PRESETS.get(dataset_name, TASK_PRESETS[task])


def sampling_for(architecture: str) -> Sampling:
    return SAMPLING.get(architecture, DEFAULT_SAMPLING)


def user_message(problem) -> str:
    """The user turn for a `datasets.Problem` (the chat template adds the rest)."""
    if problem.task == "math":
        return f"{problem.question}\n{MATH_INSTRUCTION}"
    if problem.task == "gpqa":
        choices = "\n".join(f"{letter}) {text}" for letter, text in zip("ABCD", problem.choices))
        return f"{problem.question}\n\n{choices}\n\n{GPQA_INSTRUCTION}"
    if problem.task == "code":  # LiveCodeBench's generation prompt, in its two forms
        head = ("You will be given a question (problem specification) and will generate a correct Python program "
                "that matches the specification and passes all tests.\n\n"
                f"Question: {problem.question}\n\n")
        if problem.starter_code:
            return head + ("You will use the following starter code to write the solution to the problem and "
                           f"enclose your code within delimiters.\n```python\n{problem.starter_code}\n```")
        return head + ("Read the inputs from stdin, solve the problem and write the answer to stdout (do not directly "
                       "test on the sample inputs). Enclose your code within delimiters as follows.\n"
                       "```python\n# YOUR CODE HERE\n```")
    raise ValueError(f"unknown task {problem.task!r}")
