"""Agent contexts: the chat messages each agent sees, and tokenizers that turn them into ids.

docs/algorithm.md#rollout-and-contexts. For agent ``i`` at step ``s``::

    system: profile_i
    user:   task_view_i ⊕ team_block(step 0)
    user:   feedback_0 ⊕ team_block(step 1)          # only if s ≥ 1
    …

``team_block(s')`` holds ``"[role_j]: output_j"`` for every agent of a finished step and for
agent i's parents in the team graph at the current step (agents ``j < i`` in the sequential
chain; nobody in parallel, independent-PPO, mode; see :mod:`marft_jax.rl.topology`). Blocks are joined by a blank line. If a template rejects
consecutive user turns they are merged (blank-line separated).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

Message = dict[str, str]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What happened at one finished (or current) step of one episode."""

    outputs: tuple[str, ...]          # decoded outputs of the agents that have acted, in order
    feedback: str | None = None       # the environment's message after the step


def team_block(roles: Sequence[str], outputs: Sequence[str]) -> str:
    return "\n\n".join(f"[{r}]: {o}" for r, o in zip(roles, outputs))


def _join(*parts: str) -> str:
    return "\n\n".join(p for p in parts if p)


def build_messages(
    system_prompt: str,
    task_view: str,
    roles: Sequence[str],
    history: Sequence[StepRecord],
    current_outputs: Sequence[str],
    current_roles: Sequence[str] | None = None,
) -> list[Message]:
    """Messages for one agent.

    Args:
      system_prompt: the agent's profile text.
      task_view: the task text this agent sees (heterogeneous observations allowed).
      roles: role name of every agent, in order.
      history: finished steps of this episode (all agents' outputs and the feedback).
      current_outputs: outputs of the current step visible to this agent (its parents in the
        team graph: the agents before it in the chain; none in parallel mode).
      current_roles: the role of each of ``current_outputs`` (default: ``roles`` in order, the
        chain's prefix).
    """
    msgs: list[Message] = [{"role": "system", "content": system_prompt}]
    blocks = [team_block(roles, h.outputs) for h in history]
    blocks.append(team_block(roles if current_roles is None else current_roles, current_outputs))
    msgs.append({"role": "user", "content": _join(task_view, blocks[0])})
    for h, block in zip(history, blocks[1:]):
        msgs.append({"role": "user", "content": _join(h.feedback or "", block)})
    return msgs


def merge_consecutive_users(messages: Sequence[Message]) -> list[Message]:
    out: list[Message] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"] == "user":
            out[-1] = {"role": "user", "content": _join(out[-1]["content"], m["content"])}
        else:
            out.append(dict(m))
    return out


def g1_raw_prompt(system_prompt: str, task: str, roles: Sequence[str], history: Sequence[StepRecord],
                  current_outputs: Sequence[str], agent: int, current_roles: Sequence[str] | None = None) -> str:
    """G1's raw-text context (parity runs only; special-token strings tokenized as text).
    ``current_roles`` as in :func:`build_messages`."""
    current_roles = roles if current_roles is None else current_roles
    text = system_prompt + "<|im_start|>problem: " + task + "<|im_end|>\n"
    for h in history:
        text += "".join(f"{r}: {a}\n" for r, a in zip(roles, h.outputs))
        text += f"judge: {h.feedback or 'The answer is incorrect.'}\n"
    text += "".join(f"<|im_start|>{r}: {a}<|im_end|>\n" for r, a in zip(current_roles, current_outputs))
    return text + f"<|im_start|>{roles[agent]}: "


class ChatTokenizer(Protocol):
    """What the rollout needs from a tokenizer."""

    pad_id: int
    stop_ids: tuple[int, ...]

    def encode_chat(self, messages: Sequence[Message]) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFChatTokenizer:
    """A ``transformers`` tokenizer with its chat template."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int] | None = None):
        self.tok = tokenizer
        stops = list(stop_ids or [])
        if not stops:
            for t in (tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
                if t is not None:
                    i = tokenizer.convert_tokens_to_ids(t)
                    if isinstance(i, int) and i != tokenizer.unk_token_id and i not in stops:
                        stops.append(i)
        self.stop_ids = tuple(stops)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.stop_ids[0])
        self._merge = False

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        msgs = merge_consecutive_users(messages) if self._merge else list(messages)
        try:
            # enable_thinking=False: hybrid-reasoning templates (Qwen3) otherwise open a <think> block that
            # spends the agent's token budget before the answer; other templates ignore the variable.
            out = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                               enable_thinking=False)
        except Exception:  # templates that reject consecutive user turns
            if self._merge:
                raise
            self._merge = True
            return self.encode_chat(messages)
        return list(self.tok(out, add_special_tokens=False)["input_ids"])

    def encode_text(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)
