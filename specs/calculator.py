"""The demo agent's domain: a safe calculator tool, its reward, and the prompt distribution.

The tiny model in backends/tiny is trained on exactly the questions `make_prompts` produces, so evaluation
and demos draw from here too: change the distribution and the shipped model no longer fits it.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re

SYSTEM_PROMPT = (
    "You are a helpful assistant. Use the calculator tool for arithmetic, "
    "then give the final answer on its own line after ####."
)

# The OpenAI function schema of `calculator`; tests check it equals transformers' get_json_schema of it.
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "The expression to evaluate, such as '37 * 12 + 5'.",
                }
            },
            "required": ["expression"],
        },
    },
}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_EXPRESSION_CHARS = 200  # also bounds parser recursion on inputs like "((((...))))"
_MAX_EXPONENT = 64
_MAX_MAGNITUDE = 10**18  # checked after every operation, so no intermediate result can grow without bound


def _check(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not a finite number")
    if abs(value) > _MAX_MAGNITUDE:
        raise ValueError(f"result exceeds {_MAX_MAGNITUDE:.0e} in magnitude")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (
        int,
        float,
    ):  # type(): bool is not a number here
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} exceeds {_MAX_EXPONENT}")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("result is too large") from None
    raise ValueError(
        f"unsupported syntax: {ast.unparse(node)!r} (only numbers, + - * / // % ** and parentheses)"
    )


def evaluate(expression: str) -> int | float:
    """Evaluate arithmetic by walking a whitelisted AST: never `eval`, bounded size and magnitude."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as exc:  # ValueError: integer literals past Python's digit limit
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    return _eval(tree.body)


def _format(value: int | float) -> str:
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else str(round(value, 6))
    return str(value)


async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression to evaluate, such as '37 * 12 + 5'.
    """
    return _format(evaluate(expression))


_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def compute_score(solution_str: str, ground_truth: str, **kwargs) -> float:
    """1.0 if the last `#### <number>` in the text equals ground_truth numerically, else 0.0. A row without a
    numeric ground truth cannot be scored: ValueError, whatever the model wrote."""
    if ground_truth is None:
        raise ValueError("the row has no reward_model.ground_truth to score against")
    try:
        truth = float(str(ground_truth).replace(",", ""))
    except ValueError:
        raise ValueError(f"the row's ground truth {ground_truth!r} is not a number") from None
    found = _ANSWER.findall(solution_str)
    if not found:
        return 0.0
    try:
        return float(math.isclose(float(found[-1].replace(",", "")), truth, abs_tol=1e-6))
    except ValueError:
        return 0.0


def keep_results(messages: list[dict]) -> list[dict]:
    """A context rewrite (specs/calculator_results.yaml): the model's turns that tools answered are dropped and
    their results kept, so the next turn sees the task and the observations only."""
    return [
        m
        for i, m in enumerate(messages)
        if not (
            m.get("role") == "assistant" and i + 1 < len(messages) and messages[i + 1].get("role") == "tool"
        )
    ]


def make_question(rng: random.Random) -> str:
    """An expression of 2-3 operands of 1-3 digits joined by + - *: the training distribution."""
    operands = [str(rng.randint(0, 10 ** rng.randint(1, 3) - 1)) for _ in range(rng.randint(2, 3))]
    expression = operands[0]
    for operand in operands[1:]:
        expression += f" {rng.choice('+-*')} {operand}"
    return expression


def reference_messages(expression: str) -> list[dict]:
    """The ideal episode for a question: the tiny model's training target, message by message."""
    result = _format(evaluate(expression))
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"What is {expression}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": f"The answer is {result}.\n#### {result}"},
    ]


def make_prompts(n: int, seed: int = 0) -> list[dict]:
    """n rows in verl's dataset format; the same seed gives the same rows."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = reference_messages(make_question(rng))
        rows.append(
            {
                "raw_prompt": messages[:2],
                "extra_info": {"index": i},
                "reward_model": {"ground_truth": messages[3]["content"]},
                "data_source": "calculator",
                "uid": f"calc-{seed}-{i}",
            }
        )
    return rows
