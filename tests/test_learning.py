"""End to end on the CPU: MARFT learns a relay that needs the chain; independent PPO cannot."""

from __future__ import annotations

import itertools
import time

import jax
import numpy as np
import pytest

from marft_jax.models import decoder
from marft_jax.models.config import ModelConfig
from marft_jax.models.lora import LoraConfig
from marft_jax.rl.rollout import RolloutConfig, Team
from marft_jax.rl.update import UpdateConfig
from marft_jax.sampling.sampler import Sampler, SamplingConfig
from marft_jax.train.iteration import TeamLearner
from marft_jax.train.prepare import AdvantageConfig
from marft_jax.train.state import OptimConfig, init_train_state
from tests.toy_relay import RelayTask, ToyChatTokenizer

ROWS, ITERS, LR, ENT, VALUES, KL, EPOCHS, STD = 64, 40, 5e-3, 0.01, 10, 0.05, 4, 0.1


def run_relay(level: str, mode: str, seed: int = 0, iters: int = ITERS) -> list[float]:
    tok = ToyChatTokenizer()
    cfg = ModelConfig(arch="llama", vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    base = decoder.init_params(jax.random.key(seed), cfg, std=STD)
    optim = OptimConfig(policy_lr=LR, critic_lr=1e-2)
    lora_cfg = LoraConfig(rank=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    state = init_train_state(jax.random.key(seed + 1), cfg, lora_cfg, 2, optim)
    task = RelayTask(VALUES)
    team = Team(roles=("a", "b"), system_prompts=("s", "s"), answer_agent=1)
    learner = TeamLearner(
        cfg=cfg, base=base, tokenizer=tok,
        sampler=Sampler(cfg, pad_id=tok.pad_id, stop_ids=tok.stop_ids),
        team=team, score_fn=lambda ts: [task.score(t) for t in ts],
        rollout_cfg=RolloutConfig(mode=mode, max_new_tokens=1, context_window=64),
        sampling=SamplingConfig(max_new_tokens=1, temperature=1.0),
        update_cfg=UpdateConfig(level=level, optim=optim, epochs=EPOCHS, num_minibatches=2, kl_stop=KL,
                                ent_coef=ENT, max_grad_norm=1.0, clip_eps=0.2),
        adv_cfg=AdvantageConfig(level=level, gamma=1.0, lam=1.0, independent=(mode == "parallel")),
    )
    problems = task.problems("train", seed)
    key = jax.random.key(seed + 2)
    acc, env = [], 0
    for it in range(iters):
        key, k = jax.random.split(key)
        batch = list(itertools.islice(problems, ROWS))
        state, metrics, _ = learner.iteration(state, batch, iteration=it, env_samples=env, key=k)
        env = metrics["env_samples"]
        acc.append(metrics["episode/accuracy"])
    return acc


@pytest.mark.slow
@pytest.mark.parametrize("level", ["action", "token"])
def test_marft_learns_relay(level):
    t0 = time.perf_counter()
    acc = run_relay(level, "sequential")
    print(level, [round(a, 2) for a in acc], f"{time.perf_counter() - t0:.0f}s")
    assert np.mean(acc[:3]) < 0.3
    assert max(np.mean(acc[i:i + 3]) for i in range(len(acc) - 2)) >= 0.9


@pytest.mark.slow
def test_independent_ppo_stays_near_chance():
    acc = run_relay("action", "parallel")
    print("ippo", [round(a, 2) for a in acc])
    assert np.mean(acc[-5:]) < 0.35
