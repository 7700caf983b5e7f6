"""Memory plans of compiled programs and the warm-up check against the machine.

The PPO-update figures come from XLA's buffer assignment of ``ppo_update`` compiled (never run)
for a tiny random model at context + action length T = 512 and 2048 with the same rows.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.models import decoder
from marft_jax.config import AlgoConfig, LoraConfig, OptimConfig, PPOConfig
from marft_jax.models.config import ModelConfig
from marft_jax.rl.state import init_train_state
from marft_jax.rl.update import UpdateBatch, UpdateConfig, ppo_update
from marft_jax.train import memory_plan as mp
from marft_jax.train.compile_count import CompileCounter

CFG = ModelConfig(arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
S, B, N = 1, 2, 2            # the update scans over agents: R = S * B rows per agent program
F32 = 4

# One layer's attention scores are [R, heads, T, T] float32 in our decoder (models/decoder.py
# `attention`). With remat the backward pass rebuilds one layer at a time, so at most a few such
# tensors are live together (scores, probabilities, and their cotangents): ATTN_LIVE of them.
# Measured (2 layers, T=2048): temp = 3.3 x one layer's scores; 4 layers: the same.
ATTN_LIVE = 4


def attention_bytes(t: int) -> int:
    """Bytes of one layer's float32 attention-score tensor for one agent's rows."""
    return S * B * CFG.num_heads * t * t * F32


def _batch(t: int, level: str = "token", concrete: bool = False) -> UpdateBatch:
    """Update batch with context 3T/4 and action T/4: abstract structs, or concrete arrays."""
    L, K = t - t // 4, t // 4
    dp = (S, B, N, K) if level == "token" else (S, B, N)
    shapes = dict(ctx_tokens=((S, B, N, L), jnp.int32), ctx_valid=((S, B, N, L), jnp.bool_),
                  act_tokens=((S, B, N, K), jnp.int32), act_valid=((S, B, N, K), jnp.bool_),
                  logp_old=((S, B, N, K), jnp.float32), adv=(dp, jnp.float32), ret=(dp, jnp.float32),
                  v_old=(dp, jnp.float32), dp_mask=(dp, jnp.bool_), feats=(dp + (CFG.hidden_size,), jnp.float32),
                  word_count=((S, B, N), jnp.int32))
    if concrete:
        return UpdateBatch(**{k: jnp.ones(s, d) if d == jnp.bool_ else jnp.zeros(s, d)
                              for k, (s, d) in shapes.items()})
    return UpdateBatch(**{k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()})


def _abstract_model(cfg: ModelConfig):
    base = jax.eval_shape(lambda: decoder.init_params(jax.random.key(0), cfg))
    state = jax.eval_shape(lambda: init_train_state(jax.random.key(1), cfg, LoraConfig(rank=4), N, OptimConfig()))
    return base, state


FLAGS = (jax.ShapeDtypeStruct((N,), jnp.bool_), jax.ShapeDtypeStruct((), jnp.bool_))


def _update_plan(t: int, remat: bool, cfg: ModelConfig = CFG) -> dict[str, int]:
    base, state = _abstract_model(cfg)
    compiled, plan = mp.plan_of(ppo_update, base, state, _batch(t), *FLAGS, cfg=cfg,
                                ucfg=UpdateConfig(algo=AlgoConfig(level="token"), remat=remat))
    breakdown = mp.memory_breakdown(compiled)
    assert plan == (breakdown["argument"] + breakdown["output"] - breakdown["alias"] + breakdown["temp"]
                    + breakdown["generated_code"])
    return dict(breakdown, planned=plan)


@pytest.fixture(scope="module")
def update_plans() -> dict:
    plans = {(t, remat): _update_plan(t, remat) for t, remat in ((512, True), (2048, True), (2048, False))}
    mib = lambda x: f"{x / 2 ** 20:.1f} MiB"
    for (t, remat), p in plans.items():
        print(f"ppo_update T={t} remat={remat}: temp {mib(p['temp'])}, planned {mib(p['planned'])}, "
              f"one layer's scores {mib(attention_bytes(t))}")
    return plans


def test_update_temporaries_grow_linearly_plus_one_layer_of_attention(update_plans):
    small, large = update_plans[(512, True)]["temp"], update_plans[(2048, True)]["temp"]
    assert small > 0
    # Everything but attention is linear in T (activations, chunked logits); attention adds at
    # most ATTN_LIVE score tensors of a single layer, whatever the depth.
    assert large <= 4 * small + ATTN_LIVE * attention_bytes(2048), (small, large)
    # The state is donated: its bytes are in the argument and the output, aliased once.
    assert update_plans[(2048, True)]["alias"] > 0


def test_remat_plans_less_and_removes_the_depth_factor(update_plans):
    on, off = update_plans[(2048, True)], update_plans[(2048, False)]
    assert on["planned"] < off["planned"]
    print(f"remat off plans {off['temp'] / on['temp']:.2f}x the temporaries of remat on at T=2048")
    # Doubling the depth: with remat the T^2 term stays one layer's (temporaries within 10 %).
    deep = _update_plan(2048, True, dataclasses.replace(CFG, num_layers=4))
    assert deep["temp"] <= 1.1 * on["temp"], (deep["temp"], on["temp"])


def test_plan_of_real_arrays_compiles_once_and_donates_nothing(no_persistent_compile_cache):
    """The trainer plans with the real arguments, then calls: one compile, no recompile."""
    base = decoder.init_params(jax.random.key(0), CFG)
    state = init_train_state(jax.random.key(1), CFG, LoraConfig(rank=4), N, OptimConfig())
    batch = _batch(32, concrete=True)
    mask, train_policy = jnp.ones((N,), bool), jnp.asarray(True)
    ucfg = UpdateConfig(algo=AlgoConfig(level="token"), ppo=PPOConfig(kl_stop=None), remat=True)
    with CompileCounter.counting() as planning:
        _, plan = mp.plan_of(ppo_update, base, state, batch, mask, train_policy, cfg=CFG, ucfg=ucfg)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))       # lowering donated nothing
    with CompileCounter.counting() as calling:
        new_state, _ = ppo_update(base, state, batch, mask, train_policy, cfg=CFG, ucfg=ucfg)
        jax.block_until_ready(new_state)
    assert (planning.compiles, calling.compiles) == (1, 0)
    assert plan > 0


def test_abstract_structs_share_the_compiled_program(no_persistent_compile_cache):
    f = jax.jit(lambda x, y: (x * y).sum(0))
    x, y = jnp.ones((300, 5)), jnp.ones((300, 5))
    with CompileCounter.counting() as c:
        compiled, plan = mp.plan_of(f, *mp.abstract((x, y)))
        jax.block_until_ready(f(x, y))
    assert c.compiles == 1
    b = mp.memory_breakdown(compiled)
    assert b["argument"] == 2 * 300 * 5 * F32 and b["output"] == 5 * F32
    assert plan == b["argument"] + b["output"] - b["alias"] + b["temp"]


def test_donated_output_is_counted_once():
    f = jax.jit(lambda x: x * 2.0 + 1.0, donate_argnums=0)
    compiled, plan = mp.plan_of(f, jax.ShapeDtypeStruct((1000,), jnp.float32))
    b = mp.memory_breakdown(compiled)
    assert b["alias"] == 1000 * F32
    assert plan == 1000 * F32 + b["temp"]


class _NoAnalysis:
    def __init__(self, raises: bool):
        self.raises = raises

    def memory_analysis(self):
        if self.raises:
            raise NotImplementedError("no memory analysis on this backend")
        return None


def test_backends_without_analysis_give_no_plan_and_are_skipped():
    assert mp.planned_bytes(_NoAnalysis(raises=False)) is None
    assert mp.planned_bytes(_NoAnalysis(raises=True)) is None
    mp.check_fits({"ppo_update": None}, 1, keys_to_lower=mp.UPDATE_KEYS)


def test_check_fits_names_program_sizes_and_keys():
    gib = mp.GIB
    plans = {"sampler_prefill": 2 * gib, "ppo_update": int(32.6 * gib)}
    with pytest.raises(mp.MemoryPlanError) as err:
        mp.check_fits(plans, int(23 * gib), keys_to_lower=mp.UPDATE_KEYS)
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "'ppo_update'" in msg and "32.60 GiB" in msg and "23.00 GiB" in msg and "90%" in msg
    assert "sampler_prefill" not in msg                   # it fits: not named
    for key in ("ppo.micro_batches", "model.remat", "rollout.rows", "rollout.max_new_tokens",
                "rollout.context_window"):
        assert key in msg
    assert err.value.program == "ppo_update" and err.value.planned_bytes == int(32.6 * gib)
    assert err.value.available_bytes == int(23 * gib)


def test_check_fits_passes_when_it_fits_and_respects_fraction():
    gib = mp.GIB
    mp.check_fits({"ppo_update": 20 * gib}, 23 * gib, keys_to_lower=mp.UPDATE_KEYS)
    with pytest.raises(mp.MemoryPlanError):
        mp.check_fits({"ppo_update": 20 * gib}, 23 * gib, keys_to_lower=mp.UPDATE_KEYS, fraction=0.8)
    with pytest.raises(ValueError, match="fraction"):
        mp.check_fits({}, 1, keys_to_lower=(), fraction=0.0)


def test_check_fits_with_a_real_plan_and_the_machine():
    f = jax.jit(lambda x: jnp.outer(x, x).sum())
    _, plan = mp.plan_of(f, jax.ShapeDtypeStruct((4096,), jnp.float32))
    available = mp.available_bytes()
    assert available > 0
    mp.check_fits({"outer": plan}, available, keys_to_lower=("rollout.rows",))
    with pytest.raises(mp.MemoryPlanError, match="'outer'"):
        mp.check_fits({"outer": plan}, plan // 2, keys_to_lower=("rollout.rows",))


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_host_memory_respects_cgroup_v2_limit(tmp_path):
    _write(tmp_path / "meminfo", "MemTotal: 24000000 kB\nMemFree: 20000000 kB\nMemAvailable: 22000000 kB\n")
    _write(tmp_path / "self_cgroup", "0::/job\n")
    cg = tmp_path / "cg"
    _write(cg / "job" / "memory.max", f"{8 * mp.GIB}\n")
    _write(cg / "job" / "memory.current", f"{3 * mp.GIB}\n")
    _write(cg / "job" / "memory.stat", f"anon 1\ninactive_file {mp.GIB}\nactive_file 5\n")
    got = mp.host_available_bytes(tmp_path / "meminfo", cg, tmp_path / "self_cgroup")
    assert got == 6 * mp.GIB                               # 8 - (3 - 1 inactive page cache)
    _write(cg / "job" / "memory.max", "max\n")                # no limit: MemAvailable
    got = mp.host_available_bytes(tmp_path / "meminfo", cg, tmp_path / "self_cgroup")
    assert got == 22000000 * 1024


def test_host_memory_cgroup_v1_unlimited_and_limited(tmp_path):
    _write(tmp_path / "meminfo", "MemAvailable: 1000 kB\n")
    _write(tmp_path / "self_cgroup", "4:memory:/job\n0::/\n")
    d = tmp_path / "cg" / "memory" / "job"
    _write(d / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(d / "memory.usage_in_bytes", "100\n")
    assert mp.host_available_bytes(tmp_path / "meminfo", tmp_path / "cg", tmp_path / "self_cgroup") == 1000 * 1024
    _write(d / "memory.limit_in_bytes", "500000\n")
    _write(d / "memory.stat", "total_inactive_file 0\n")
    assert mp.host_available_bytes(tmp_path / "meminfo", tmp_path / "cg", tmp_path / "self_cgroup") == 500000 - 100


def test_available_bytes_is_the_host_on_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("CPU figure")
    host = mp.host_available_bytes()
    got = mp.available_bytes()
    assert got > 0 and math.isclose(got, host, rel_tol=0.2)


def test_release_free_heap_returns_freed_pages():
    """After a large NumPy buffer is freed into a fragmented heap, release_free_heap gives the
    pages back (glibc) or does nothing (elsewhere); it never raises."""
    import sys

    from marft_jax.train import host_memory

    def rss_kib() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1])
        return 0

    assert isinstance(host_memory.release_free_heap(), bool)
    if not sys.platform.startswith("linux"):
        return
    # many 64 KiB blocks (below glibc's mmap threshold: they live in the heap), every other one
    # kept so the freed ones cannot be trimmed from the top only
    blocks = [np.ones(16 * 1024, np.float32) for _ in range(4000)]
    keep = blocks[1::2]
    del blocks
    before = rss_kib()
    host_memory.release_free_heap()
    after = rss_kib()
    assert after <= before
    assert before - after > 50 * 1024, (before, after)   # ~125 MiB freed in whole pages
    del keep
