"""A toy two-agent relay task with a character-level chat tokenizer (no network, no hub).

Agent 0 sees a hidden digit; agent 1 sees only the task and agent 0's output and must say
the digit. The second agent can only be right by using the first agent's output.
:func:`pretrain_base` gives a tiny random base the prior the end-to-end learning test starts
from (see ``tests/test_learning.py``).
"""

from __future__ import annotations

import random
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from marft_jax.envs.task import Problem, Score, Transcript
from marft_jax.models import decoder
from marft_jax.models.config import ModelConfig

SPECIALS = ["<pad>", "<eos>", "<sys>", "<user>", "<asst>"]
CHARS = "0123456789" + "abdrs []:=?\n"  # a tiny alphabet keeps chance at 1/vocab low but learnable


class ToyChatTokenizer:
    """Character-level tokenizer: ids 0-4 are specials, then one id per character."""

    pad_id = 0
    eos_id = 1

    def __init__(self):
        self.vocab = SPECIALS + list(CHARS)
        self.index = {c: i for i, c in enumerate(self.vocab)}
        self.stop_ids = (self.eos_id,)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode_text(self, text: str) -> list[int]:
        return [self.index.get(c, self.index["?"]) for c in text.lower()]

    def encode_chat(self, messages) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids.append(self.index["<sys>" if m["role"] == "system" else "<user>"])
            ids += self.encode_text(m["content"])
        return ids + [self.index["<asst>"]]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.vocab[int(i)] for i in ids if int(i) >= len(SPECIALS))

    def digit_id(self, d: int) -> int:
        return self.index[str(d)]


def model_config(tok: ToyChatTokenizer) -> ModelConfig:
    """The tiny base of the learning tests: 2 layers, 64 wide, the character vocabulary."""
    return ModelConfig(arch="llama", vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)


class RelayTask:
    """Problems ``d=7`` for agent 0 and ``d=?`` for agent 1; reward 1 iff agent 1 says the digit."""

    name = "relay"
    kind = "math"

    def __init__(self, num_values: int = 10):
        self.num_values = num_values

    def problems(self, split: str, seed: int = 0) -> Iterator[Problem]:
        rng = random.Random(f"{split}-{seed}")
        i = 0
        while True:
            d = rng.randrange(self.num_values)
            yield Problem(uid=f"relay:{split}:{i}", text="d=?", answer=str(d),
                          agent_views=(f"d={d}", "d=?"))
            i += 1

    def score(self, transcript: Transcript) -> Score:
        out = transcript.answer_text.strip()
        ok = out[:1] == transcript.problem.answer
        return Score(1.0 if ok else 0.0, {"extracted": out[:1], "reason": None if ok else "wrong"})


def relay_context(tok: ToyChatTokenizer, view: str, teammate: str | None = None, system: str = "s") -> list[int]:
    """The chat context the rollout builds (``build_messages``) for a relay agent."""
    content = view if teammate is None else f"{view}\n\n[a]: {teammate}"
    return tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": content}])


def pretrain_base(base, cfg, tok: ToyChatTokenizer, *, num_values: int = 10, steps: int = 150, rows: int = 64,
                  lr: float = 3e-3, seed: int = 0):
    """Full-parameter supervised pre-training that gives the tiny random base a prior.

    Half the examples are ``d=7`` -> ``7<eos>`` (read the digit after ``=``); the other half
    are ``d=?`` -> a uniformly random digit, then ``<eos>`` (a hidden value means guessing),
    and half of those carry a teammate message ``[a]: X`` with an unrelated digit X, so the
    base treats what a teammate says as noise. Afterwards agent 0's context ``d=7`` yields
    ``7`` and agent 1's context ``d=?\n\n[a]: 7`` yields a uniform guess: the team is at
    chance until agent 1 learns to use agent 0's output. Returns the new base parameters.
    """

    def example(rng: np.random.Generator) -> tuple[list[int], list[int]]:
        d = int(rng.integers(num_values))
        if rng.random() < 0.5:
            prompt, target = relay_context(tok, f"d={d}"), d
        else:
            teammate = str(d) if rng.random() < 0.5 else None
            prompt, target = relay_context(tok, "d=?", teammate), int(rng.integers(num_values))
        return prompt, [tok.digit_id(target), tok.eos_id]

    return supervised_pretrain(base, cfg, tok, example, steps=steps, rows=rows, lr=lr, seed=seed)


def supervised_pretrain(base, cfg, tok: ToyChatTokenizer, example, *, steps: int, rows: int, lr: float,
                        seed: int):
    """Full-parameter Adam on ``rows`` examples per step, each ``example(rng)`` -> (prompt ids,
    target ids); the loss is the mean next-token NLL of the target ids (sequences left-padded,
    targets last). Returns the new base parameters."""
    rng = np.random.default_rng(seed)

    def batch():
        pairs = [example(rng) for _ in range(rows)]
        seqs = [p + t for p, t in pairs]
        width = max(map(len, seqs))
        T = max(len(t) for _, t in pairs)
        toks = np.full((rows, width), tok.pad_id, np.int32)
        valid = np.zeros((rows, width), bool)
        is_target = np.zeros((rows, T), np.float32)     # over the last T positions
        for i, (s, (_, t)) in enumerate(zip(seqs, pairs)):
            toks[i, width - len(s):] = s
            valid[i, width - len(s):] = True
            is_target[i, T - len(t):] = 1.0
        return toks, valid, is_target

    opt = optax.adam(lr)

    @jax.jit
    def step(params, opt_state, toks, valid, is_target):
        def loss_fn(p):
            logits = decoder.logits_fn(p, toks[:, :-1], valid[:, :-1], cfg)
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1)[..., 0]
            T = is_target.shape[1]
            return jnp.sum(nll[:, -T:] * is_target) / jnp.sum(is_target)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(base)
    for _ in range(steps):
        base, opt_state, _ = step(base, opt_state, *batch())
    return base
