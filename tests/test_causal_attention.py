"""The native whole-row attention (``model.causal_attention=native``): forward and backward
against the XLA path (dense masked softmax), at small shapes, at the reference workload's row length,
on every instruction-set body of the kernel, inside the decoder's remat'd layer scan and vmap,
and the config key's resolution. Its speed: docs/benchmarks.md (a benchmark, not a test)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.models import attention as attention_lib
from marft_jax.models import causal_attention, decoder, lora as lora_lib
from marft_jax.models import logprobs as lp_lib
from marft_jax.config import LoraConfig
from marft_jax.models.config import ModelConfig

pytestmark = pytest.mark.skipif(not causal_attention.status().available,
                                reason=f"native kernel unavailable: {causal_attention.status().reason}")


def _inputs(b, t, nh, nkv, d, seed, holes=True):
    """Random q/k/v, a packed-row mask (three segments, trailing padding, a fully padded last
    row when b > 2, and with ``holes`` a band of keys no query sees: a shared-prefix branch's
    gap), the valid queries and an output weighting that ignores padding."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, nh, d)) * 1.5, jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, nkv, t, d)) * 1.5, jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, nkv, t, d)), jnp.float32)
    seg = np.zeros((b, t), np.int32)
    for r in range(b):
        if b > 2 and r == b - 1:
            continue                                                   # a row of padding only
        cuts = np.sort(rng.choice(np.arange(1, t), 2, replace=False)) if t > 3 else np.array([1, 2])
        end = t - int(rng.integers(0, max(t // 5, 1)))
        seg[r, :cuts[0]], seg[r, cuts[0]:cuts[1]], seg[r, cuts[1]:end] = 1, 2, 3
    mask = np.array(attention_lib.segment_mask(jnp.asarray(seg)))
    if holes and t > 12:
        mask[:, 10:, 5:9] = False
    mask = jnp.asarray(mask)
    valid = jnp.asarray(mask.any(-1))
    w = jnp.asarray(rng.normal(size=(b, t, nh, d)), jnp.float32) * valid[:, :, None, None]
    return q, k, v, mask, valid, w


def _compare(q, k, v, mask, valid, w, atol=5e-6):
    # the dense XLA path (one masked softmax; the blocked causal path equals it: test_attention.py)
    ref = lambda q, k, v: attention_lib.xla_attention(q, k, v, mask, causal=False)
    nat = lambda q, k, v: causal_attention.attend(q, k, v, mask)
    keep = valid[:, :, None, None]
    got, want = jax.jit(nat)(q, k, v) * keep, jax.jit(ref)(q, k, v) * keep
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=1e-5)
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * w))
    g_nat = jax.jit(jax.grad(loss(nat), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", g_nat, g_ref):
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6 * scale + 1e-6, err_msg=f"d{name}")


@pytest.mark.parametrize("b,t,nh,nkv,d", [
    (2, 100, 9, 3, 64),     # SmolLM2's heads; a row length that is not a multiple of 16
    (3, 37, 6, 2, 48),      # a head width without the 64-column fast path; a padding-only row
    (1, 64, 4, 4, 128),     # no grouping, 128-wide heads (two column blocks)
    (2, 7, 2, 1, 16),       # shorter than one key block
])
def test_attend_equals_xla_attention(b, t, nh, nkv, d):
    """Values and gradients (q, k, v) equal the XLA path's on packed rows with padding,
    a padding-only row and a masked band inside a segment."""
    _compare(*_inputs(b, t, nh, nkv, d, seed=b * t + d))


def test_attend_at_the_reference_workload_row_length():
    """A 1,504-token row (the reference workload's packed update rows), SmolLM2's 9 query / 3 kv
    heads of 64: the causal key range grows to the whole row, every forward task chunk is used."""
    q, k, v, mask, valid, w = _inputs(1, 1504, 9, 3, 64, seed=7, holes=False)
    _compare(q, k, v, mask, valid, w)


def test_masked_key_blocks_are_skipped_exactly():
    """A second segment that starts late in the row: its queries' key range begins at the
    segment (the blocks before it are skipped), results still equal the XLA path's."""
    b, t = 2, 200
    seg = np.zeros((b, t), np.int32)
    seg[:, :150], seg[:, 150:] = 1, 2
    mask = attention_lib.segment_mask(jnp.asarray(seg))
    q, k, v, _, _, _ = _inputs(b, t, 4, 2, 32, seed=3)
    w = jnp.ones((b, t, 4, 32), jnp.float32)
    _compare(q, k, v, mask, jnp.ones((b, t), bool), w)


@pytest.mark.parametrize("nh,nkv", [(2, 1), (9, 3)])
def test_backward_splits_a_row_at_its_segments(nh, nkv):
    """One long packed row of units at multiples of SEGMENT_ALIGN (the segment-mode packing), one
    unit with shared-prefix branches, one at an unaligned start, trailing padding: the backward
    runs each run of segments as its own task (each alone writes its keys' dk / dv rows; with
    few heads a row is split into several); gradients equal the XLA path's."""
    t, a = 1000, causal_attention.SEGMENT_ALIGN
    starts = [0, 64 * a // 4, 50 * a, 50 * a + 37, 170 * a, 230 * a]   # 50a + 37: not aligned
    seg = np.zeros((1, t), np.int32)
    for j, (s0, s1) in enumerate(zip(starts, starts[1:] + [960])):
        seg[0, s0:s1] = j + 1
    mask = np.array(attention_lib.segment_mask(jnp.asarray(seg)))
    mask[:, 700:, 690:698] = False                                      # branches inside the fifth unit
    mask = jnp.asarray(mask)
    q, k, v, _, _, _ = _inputs(1, t, nh, nkv, 32, seed=11)
    valid = mask.any(-1)
    w = jnp.asarray(np.random.default_rng(5).normal(size=(1, t, nh, 32)), jnp.float32) * valid[:, :, None, None]
    _compare(q, k, v, mask, valid, w)


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_every_instruction_set_body(isa, tmp_path):
    """The kernel is compiled for AVX-512 (16 lanes), AVX2 + FMA (8) and portably (4: SSE2 /
    NEON); a machine uses the best it has. ``MARFT_JAX_CAUSAL_ATTENTION_ISA`` caps the choice,
    so each body is checked here (in a fresh process: the choice is made once per process)."""
    if isa == "avx2" and not _cpu_has("avx2"):
        pytest.skip("this CPU has no AVX2")
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, %r)
        from tests.test_causal_attention import _compare, _inputs, test_backward_splits_a_row_at_its_segments
        _compare(*_inputs(2, 100, 9, 3, 64, seed=1))
        _compare(*_inputs(3, 37, 6, 2, 48, seed=2))
        test_backward_splits_a_row_at_its_segments(2, 1)
        print("ok")
    """ % os.getcwd())
    env = dict(os.environ, MARFT_JAX_CAUSAL_ATTENTION_ISA=isa, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return f" {flag}" in f.read()
    except OSError:
        return False


def _tiny(**kw) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=16, **kw)


def test_decoder_logprobs_and_lora_gradient_native_equals_xla():
    """The update's path: action log-probs under each agent's LoRA, with the decoder's remat'd
    layer scan and a vmap over agents (the FFI call runs once per agent), and the LoRA
    gradient: equal with ``causal_attention`` native and xla."""
    cfg = _tiny()
    params = decoder.init_params(jax.random.key(0), cfg)
    lora = lora_lib.init_lora(jax.random.key(1), cfg, LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj")), 2)
    lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape, x.dtype), lora)
    rng = np.random.default_rng(0)
    n, L, K = 3, 40, 9
    ctx = jnp.asarray(rng.integers(3, 97, (2, n, L)), jnp.int32)
    ctx_valid = jnp.asarray(np.arange(L) >= rng.integers(0, L // 2, (2, n, 1)))
    act = jnp.asarray(rng.integers(3, 97, (2, n, K)), jnp.int32)
    act_valid = jnp.asarray(np.arange(K) < rng.integers(1, K + 1, (2, n, 1)))

    def loss(lora, c):
        def one(agent, ct, cv, at, av):
            logp, ent = lp_lib.action_logprobs_fn(params, lora, agent, ct, cv, at, av, 1.0, cfg=c, remat=True)
            return jnp.sum(logp) + 0.1 * jnp.sum(ent)
        return jnp.sum(jax.vmap(one)(jnp.arange(2), ctx, ctx_valid, act, act_valid))

    results = {}
    for impl in ("xla", "native"):
        c = dataclasses.replace(cfg, causal_attention=impl)
        results[impl] = jax.jit(jax.value_and_grad(lambda lo: loss(lo, c)))(lora)
    (v_x, g_x), (v_n, g_n) = results["xla"], results["native"]
    np.testing.assert_allclose(float(v_n), float(v_x), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_n), jax.tree.leaves(g_x)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-7)


def test_compiled_training_pass_has_the_ffi_and_no_blocked_dots():
    """With ``native`` the compiled gradient of a decoder forward calls the kernel (forward and
    backward) and runs fewer dots than the XLA path (whose attention is per-block score and
    value dots); the XLA program never calls the kernel."""
    cfg = dataclasses.replace(_tiny(), causal_attention="native")
    params = decoder.init_params(jax.random.key(0), cfg)
    toks = jnp.ones((2, 160), jnp.int32)
    valid = jnp.ones((2, 160), bool)
    f = lambda p: jnp.sum(decoder.forward(p, toks, valid, cfg=cfg, remat="full")[0] ** 2)
    hlo = jax.jit(jax.grad(f)).lower(params).compile().as_text()
    assert causal_attention.FORWARD in hlo and causal_attention.BACKWARD in hlo
    xla_hlo = jax.jit(jax.grad(lambda p: jnp.sum(decoder.forward(
        p, toks, valid, cfg=dataclasses.replace(cfg, causal_attention="xla"), remat="full")[0] ** 2))).lower(
        params).compile().as_text()
    assert causal_attention.FORWARD not in xla_hlo
    assert hlo.count(" dot(") < xla_hlo.count(" dot(")


def test_keep_attention_remat_skips_the_kernel_forward_in_the_backward():
    """``model.remat=keep_attention`` keeps the kernel's output and log-sum-exp: the compiled
    value-and-gradient of a layer scan runs the forward kernel once (``full``: again in the
    backward's recompute), with equal values and gradients; ``auto`` picks it for long rows."""
    cfg = dataclasses.replace(_tiny(), causal_attention="native")
    params = decoder.init_params(jax.random.key(0), cfg)
    rng = np.random.default_rng(1)
    toks = jnp.asarray(rng.integers(3, 97, (2, 96)), jnp.int32)
    valid = jnp.asarray(np.arange(96) >= rng.integers(0, 30, (2, 1)))
    out = {}
    for remat in ("full", "keep_attention"):
        f = jax.jit(jax.value_and_grad(lambda p: jnp.sum(decoder.forward(p, toks, valid, cfg=cfg, remat=remat)[0] ** 2)))
        calls = f.lower(params).compile().as_text().count(f'custom_call_target="{causal_attention.FORWARD}"')
        out[remat] = (calls, f(params))
    assert out["full"][0] == 2 and out["keep_attention"][0] == 1
    np.testing.assert_allclose(float(out["keep_attention"][1][0]), float(out["full"][1][0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(out["keep_attention"][1][1]), jax.tree.leaves(out["full"][1][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * float(jnp.max(jnp.abs(b))) + 1e-7)
    assert decoder.resolve_remat(None, decoder.REMAT_AUTO_LEN) == "keep_attention"
    assert decoder.resolve_remat("auto", decoder.REMAT_AUTO_LEN - 1) == "none"
    assert decoder.resolve_remat(True, 10) == "full"


def test_resolve(monkeypatch):
    """``auto``: native on one CPU device in float32 with AVX2 / AVX-512, xla elsewhere (and on a
    CPU with only the portable body); ``native`` where it cannot run names the key; a bad value too."""
    monkeypatch.setattr(causal_attention, "vector_units", lambda: True)
    assert causal_attention.resolve("auto", backend="cpu", dtype=jnp.float32, devices=1) == "native"
    monkeypatch.setattr(causal_attention, "vector_units", lambda: False)
    assert causal_attention.resolve("auto", backend="cpu", dtype=jnp.float32, devices=1) == "xla"
    assert causal_attention.resolve("native", backend="cpu", dtype=jnp.float32, devices=1) == "native"
    assert causal_attention.resolve("auto", backend="cpu", dtype=jnp.bfloat16, devices=1) == "xla"
    assert causal_attention.resolve("auto", backend="cpu", devices=4) == "xla"
    assert causal_attention.resolve("auto", backend="gpu", dtype=jnp.bfloat16, devices=1) == "xla"
    assert causal_attention.resolve("xla", backend="cpu", devices=1) == "xla"
    with pytest.raises(ValueError, match="model.causal_attention=native"):
        causal_attention.resolve("native", backend="cpu", devices=2)
    with pytest.raises(ValueError, match="model.causal_attention"):
        causal_attention.resolve("fast", backend="cpu", devices=1)
    with pytest.raises(ValueError, match="causal_attention"):
        ModelConfig(arch="llama", vocab_size=8, hidden_size=16, intermediate_size=16, num_layers=1, num_heads=1,
                    num_kv_heads=1, head_dim=16, causal_attention="auto")


def test_config_key_is_checked():
    from marft_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.causal_attention"):
        load_config("demo", ["model.causal_attention=fast"])


def test_bench_attention_reports_both_sides_and_the_floor(capsys):
    """`marft-jax bench attention` at a tiny shape: the last stdout line is the JSON report with
    both sides, their ratio and the floor for the forward and forward + backward programs."""
    import json

    from marft_jax.bench import attention as bench

    rep = bench.main(["--rows", "1", "--tokens", "40", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                      "--repeats", "1", "--roofline-n", "128"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["programs"].keys() == rep["programs"].keys() == {"forward", "forward_backward"}
    for prog in last["programs"].values():
        assert prog["ours_s"] > 0 and prog["baseline_s"] > 0 and prog["floor_s"] > 0
        assert prog["ratio"] == pytest.approx(prog["baseline_s"] / prog["ours_s"])
        assert prog["ours_over_floor"] == pytest.approx(prog["ours_s"] / prog["floor_s"])
    fb = last["programs"]["forward_backward"]["flops"]
    assert fb == pytest.approx(14 * 2 * 40 * 41 / 2 * 16)
