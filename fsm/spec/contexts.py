"""How a model turn's context is built and rewritten (docs/contexts.md): the `context:` section of a spec, its
policy and its named rewrites (a summary, a window or a function), each usable as a state's action."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fsm.spec.base import MAX_TOKENS, MAX_TURNS, Strict


class SummaryRewrite(Strict):
    """The model summarizes the conversation; the summary replaces everything after the task."""

    instruction: str = Field(
        default="Summarize the work so far: what was asked, what was tried, the intermediate results and what is "
        "left to do. Be brief.",
        description="Appended as a user message after the conversation; the model's answer is the summary.",
    )
    max_new_tokens: int | None = Field(
        default=None,
        gt=0,
        le=MAX_TOKENS,
        description="The summary turn's cap; default: limits.max_new_tokens.",
    )
    prefix: str = Field(
        default="Summary of the work so far:\n",
        description="Put before the summary in the user message that replaces the history.",
    )


class RewriteSpec(Strict):
    """One named rewrite, used as a state's `action`. Exactly one of summary, keep_last, function."""

    summary: SummaryRewrite | None = Field(
        default=None, description="A model-written summary: its own turn is a training segment too."
    )
    keep_last: int | None = Field(
        default=None,
        gt=0,
        le=MAX_TURNS,
        description="A window: keep the task (the messages up to the first user message) and the last N "
        "exchanges (a model turn and the observations that answer it).",
    )
    function: str | None = Field(
        default=None,
        description="module:function(messages) -> messages (sync or async), the new conversation.",
    )

    @model_validator(mode="after")
    def _one(self) -> RewriteSpec:
        chosen = [k for k in ("summary", "keep_last", "function") if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ValueError(
                f"a rewrite is exactly one of summary, keep_last, function; got {chosen or 'none'}"
            )
        return self

    @property
    def kind(self) -> str:
        return (
            "summary" if self.summary is not None else "window" if self.keep_last is not None else "function"
        )


class ContextSpec(Strict):
    """How each model turn's context is built, and what a rewrite does (docs/contexts.md)."""

    policy: Literal["append", "template"] = Field(
        default="append",
        description="append: observations are appended to the tokens so far (one segment unless a rewrite "
        "action runs). template: each model turn's prompt is the chat template's render of the conversation so "
        "far, as a chat server builds it (earlier reasoning dropped where the template drops it); when that "
        "render does not extend the current segment's tokens, a new segment starts with it as its prompt.",
    )
    rewrites: dict[str, RewriteSpec] = Field(
        default_factory=dict,
        description="Named rewrites, each usable as a state's action; each starts a new segment.",
    )
    reward_placement: Literal["last", "every"] = Field(
        default="last",
        description="A segmented trajectory's reward in the batch: on its last segment only (the others 0.0), "
        "or on every segment (session-level GRPO).",
    )
