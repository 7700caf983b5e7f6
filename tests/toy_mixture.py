"""A toy mixture task: two proposers each see half of the answer, an aggregator needs both.

Proposer ``a`` sees ``a=3``, proposer ``b`` sees ``b=5``; the aggregator sees only ``d=??``
and, in a team graph that lets it read them, the proposers' outputs. The answer is the pair
``35``; the aggregator can only be right by using both proposers' outputs. The character
tokenizer and the supervised pre-training loop come from ``tests/toy_relay.py``.
:func:`pretrain_mixture_base` gives a tiny random base the prior the learning test starts from
(see ``tests/test_learning_mixture.py``).
"""

from __future__ import annotations

import random
from typing import Iterator, Sequence

import numpy as np

from marft_jax.envs.chat import build_messages
from marft_jax.envs.task import Problem, Score, Transcript
from tests.toy_relay import ToyChatTokenizer, supervised_pretrain

ROLES = ("a", "b", "s")          # proposer a, proposer b, aggregator (role names in the tiny alphabet)
HIDDEN = "d=??"                  # the aggregator's own view


class MixtureTask:
    """Problems with views ``a=3``, ``b=5``, ``d=??``; the answer ``35`` is scored on the
    aggregator's (agent 2's) output, or on each agent's own output for independent agents.

    ``partial_credit``: the reward is the fraction of the two digits right (0, 0.5, 1) instead
    of 1 iff both are; ``info["exact"]`` always says whether both are.
    """

    name = "mixture"
    kind = "math"

    def __init__(self, num_values: int = 10, partial_credit: bool = True):
        self.num_values = num_values
        self.partial_credit = partial_credit

    def problems(self, split: str, seed: int = 0) -> Iterator[Problem]:
        rng = random.Random(f"mixture-{split}-{seed}")
        i = 0
        while True:
            x, y = rng.randrange(self.num_values), rng.randrange(self.num_values)
            yield Problem(uid=f"mixture:{split}:{i}", text=HIDDEN, answer=f"{x}{y}",
                          agent_views=(f"a={x}", f"b={y}", HIDDEN))
            i += 1

    @staticmethod
    def exact(text: str, problem: Problem) -> bool:
        """Whether ``text`` (an aggregator's output) starts with the pair."""
        return text.strip()[:2] == problem.answer

    def score(self, transcript: Transcript) -> Score:
        out = transcript.answer_text.strip()[:2]
        right = sum(o == g for o, g in zip(out, transcript.problem.answer))
        exact = self.exact(out, transcript.problem)
        reward = right / 2 if self.partial_credit else float(exact)
        return Score(reward, {"extracted": out, "exact": exact, "reason": None if exact else "wrong"})


def mixture_context(tok: ToyChatTokenizer, view: str, teammates: Sequence[tuple[str, str]] = (),
                    system: str = "s") -> list[int]:
    """The chat context the rollout builds for an agent that reads ``teammates`` ((role, output)
    pairs of the current step)."""
    msgs = build_messages(system, view, ROLES, [], [o for _, o in teammates],
                          current_roles=[r for r, _ in teammates])
    return tok.encode_chat(msgs)


def pretrain_mixture_base(base, cfg, tok: ToyChatTokenizer, *, num_values: int = 10, steps: int = 200,
                          rows: int = 64, lr: float = 3e-3, seed: int = 0):
    """Full-parameter supervised pre-training that gives the tiny random base a prior.

    Half the examples are a proposer's: ``a=3`` -> ``3<eos>`` or ``b=5`` -> ``5<eos>``, the
    latter with, half the time, a teammate message ``[a]: X`` (an unrelated digit; proposer b
    reads proposer a in the chain graph). The other half are the aggregator's: ``d=??`` -> two
    uniformly random digits, then ``<eos>``, with ``[a]: X`` and/or ``[b]: Y`` (unrelated
    digits) or neither, so the base treats what teammates say as noise. Afterwards the proposers
    pass their digits on and the aggregator guesses: the team is at chance (0.01 exact, 0.1
    per digit) until the aggregator learns to read both proposers. Returns the new base
    parameters.
    """

    def digit(rng) -> int:
        return int(rng.integers(num_values))

    def example(rng: np.random.Generator) -> tuple[list[int], list[int]]:
        if rng.random() < 0.5:
            v = digit(rng)
            if rng.random() < 0.5:
                prompt = mixture_context(tok, f"a={v}")
            else:
                mates = [("a", str(digit(rng)))] if rng.random() < 0.5 else []
                prompt = mixture_context(tok, f"b={v}", mates)
            return prompt, [tok.digit_id(v), tok.eos_id]
        mates = [(r, str(digit(rng))) for r in ("a", "b") if rng.random() < 0.5]
        return mixture_context(tok, HIDDEN, mates), [tok.digit_id(digit(rng)), tok.digit_id(digit(rng)), tok.eos_id]

    return supervised_pretrain(base, cfg, tok, example, steps=steps, rows=rows, lr=lr, seed=seed)
