"""Per-agent LoRA vs Hugging Face PEFT on tiny random HF twins (float32, CPU, no network).

Reference: ``peft.get_peft_model`` / ``PeftModel.from_pretrained`` on the HF PyTorch twin with
the same A/B weights. Tolerance: max abs logit error <= 1e-4 over valid positions.
"""

from __future__ import annotations

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from marft_jax.models import decoder, peft_io  # noqa: E402
from marft_jax.config import LoraConfig  # noqa: E402
from marft_jax.models.lora import TARGETS, LoraStack, init_lora  # noqa: E402
from tests import hf_tiny  # noqa: E402

TOL = 1e-4
QV = ("q_proj", "v_proj")
# One rank, alpha and agent count everywhere: each distinct LoRA structure is one more jit compile.
RANK, ALPHA, AGENTS = 4, 8.0, 3


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def twin(request):
    model = hf_tiny.tiny_hf_model(request.param)
    cfg, params = hf_tiny.to_jax(model)
    return request.param, model, cfg, params


def random_stack(cfg, targets, rank=RANK, alpha=ALPHA, num_agents=AGENTS, seed=0) -> LoraStack:
    """Random A and NONZERO random B for every agent (so the adapter visibly moves the logits)."""
    stack = init_lora(jax.random.PRNGKey(seed), cfg, LoraConfig(rank=rank, alpha=alpha, targets=targets),
                      num_agents)
    keys = jax.random.split(jax.random.PRNGKey(seed + 100), len(targets))
    b = {t: 0.1 * jax.random.normal(k, stack.b[t].shape, jnp.float32) for k, t in zip(keys, targets)}
    return LoraStack(a=stack.a, b=b, scale=stack.scale)


def peft_twin(model, stack: LoraStack, agent: int):
    """A PEFT-wrapped deep copy of ``model`` with ``agent``'s A/B copied in (PEFT layout [out, in])."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    r = stack.a[stack.targets[0]].shape[-1]
    pcfg = PeftLoraConfig(r=r, lora_alpha=stack.scale * r, target_modules=list(stack.targets),
                          lora_dropout=0.0, init_lora_weights=False)
    pm = get_peft_model(copy.deepcopy(model), pcfg).eval()
    sd = {}
    for t in stack.targets:
        a, b = np.asarray(stack.a[t][agent]), np.asarray(stack.b[t][agent])
        for i in range(a.shape[0]):
            mod = peft_io.peft_module_path(t)
            sd[f"base_model.model.model.layers.{i}.{mod}.lora_A.default.weight"] = torch.from_numpy(a[i].T.copy())
            sd[f"base_model.model.model.layers.{i}.{mod}.lora_B.default.weight"] = torch.from_numpy(b[i].T.copy())
    missing = set(sd) - set(pm.state_dict())
    assert not missing, sorted(missing)[:3]
    pm.load_state_dict(sd, strict=False)
    return pm


def ours(cfg, params, tokens, valid, stack=None, agent=None):
    out = decoder.logits_fn(params, jnp.asarray(tokens), jnp.asarray(valid), cfg=cfg, lora=stack,
                            agent=None if agent is None else jnp.asarray(agent, jnp.int32))
    return np.asarray(out)


def batch(cfg):
    return hf_tiny.left_padded_batch([10, 4, 7], cfg.vocab_size, 10, seed=3)


@pytest.mark.parametrize("targets", [QV, TARGETS], ids=["q_v", "all7"])
def test_lora_logits_match_peft(twin, targets):
    _, model, cfg, params = twin
    stack = random_stack(cfg, targets)
    tokens, valid = batch(cfg)
    for agent in (0, 1):
        want = hf_tiny.hf_logits(peft_twin(model, stack, agent), tokens, valid)
        got = ours(cfg, params, tokens, valid, stack, agent)
        err = np.abs(got - want)[valid].max()
        assert err <= TOL, (agent, err)
    base = hf_tiny.hf_logits(model, tokens, valid)
    assert np.abs(got - base)[valid].max() > 1e-2, "the adapter should move the logits (test not vacuous)"


def test_fresh_adapter_is_identity(twin):
    _, _, cfg, params = twin
    stack = init_lora(jax.random.PRNGKey(1), cfg, LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS), AGENTS)
    tokens, valid = batch(cfg)
    base = ours(cfg, params, tokens, valid)
    for agent in (0, 2):
        got = ours(cfg, params, tokens, valid, stack, agent)
        assert np.abs(got - base)[valid].max() <= 1e-6


def test_export_loads_in_peft_and_imports_bit_exactly(twin, tmp_path):
    from peft import PeftModel

    arch, model, cfg, params = twin
    stack = random_stack(cfg, TARGETS, seed=7)
    out = peft_io.export_peft(stack, 1, tmp_path / "agent1", base_model_name=f"tiny-{arch}")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["agent1"]  # no temporary folders left behind
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["task_type"] == "CAUSAL_LM"
    assert (conf["r"], conf["lora_alpha"], conf["lora_dropout"], conf["bias"]) == (RANK, 8, 0.0, "none")
    assert conf["target_modules"] == list(TARGETS)
    assert conf["base_model_name_or_path"] == f"tiny-{arch}"

    pm = PeftModel.from_pretrained(copy.deepcopy(model), str(out)).eval()
    tokens, valid = batch(cfg)
    want = hf_tiny.hf_logits(pm, tokens, valid)
    got = ours(cfg, params, tokens, valid, stack, 1)
    assert np.abs(got - want)[valid].max() <= TOL

    back = peft_io.import_peft(out, cfg)
    assert back.num_agents == 1 and back.scale == stack.scale and set(back.targets) == set(stack.targets)
    for t in stack.targets:
        np.testing.assert_array_equal(np.asarray(back.a[t][0]), np.asarray(stack.a[t][1]))
        np.testing.assert_array_equal(np.asarray(back.b[t][0]), np.asarray(stack.b[t][1]))

    # Into slot 0 of a fresh stack: that slot now equals agent 1, the others are untouched.
    fresh = init_lora(jax.random.PRNGKey(9), cfg, LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS), 2)
    merged = peft_io.put_agent_adapter(fresh, 0, back)
    for t in stack.targets:
        np.testing.assert_array_equal(np.asarray(merged.a[t][0]), np.asarray(stack.a[t][1]))
        np.testing.assert_array_equal(np.asarray(merged.b[t][0]), np.asarray(stack.b[t][1]))
        np.testing.assert_array_equal(np.asarray(merged.a[t][1]), np.asarray(fresh.a[t][1]))
    with pytest.raises(ValueError, match="scale"):
        peft_io.put_agent_adapter(init_lora(jax.random.PRNGKey(0), cfg, LoraConfig(
            rank=RANK, alpha=2 * ALPHA, targets=TARGETS), 2), 0, back)


def test_per_row_agent_equals_separate_runs(twin):
    _, _, cfg, params = twin
    stack = random_stack(cfg, TARGETS, seed=11)
    tokens, valid = batch(cfg)
    agents = np.array([2, 0, 1], np.int32)
    mixed = ours(cfg, params, tokens, valid, stack, agents)
    for row, k in enumerate(agents):
        alone = ours(cfg, params, tokens, valid, stack, int(k))
        err = np.abs(mixed[row] - alone[row])[valid[row]].max()
        assert err <= 1e-5, (row, k, err)
    assert np.abs(mixed[0] - ours(cfg, params, tokens, valid, stack, 0)[0])[valid[0]].max() > 1e-3


def test_atomic_export_replaces_and_cleans_up(twin, tmp_path, monkeypatch):
    _, _, cfg, _ = twin
    s1, s2 = random_stack(cfg, QV, seed=1), random_stack(cfg, QV, seed=2)
    dest = tmp_path / "adapter"
    peft_io.export_peft(s1, 0, dest, "base")
    peft_io.export_peft(s2, 0, dest, "base")  # replaces the existing adapter
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]
    np.testing.assert_array_equal(np.asarray(peft_io.import_peft(dest, cfg).b["q_proj"][0]),
                                  np.asarray(s2.b["q_proj"][0]))

    import safetensors.numpy

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        peft_io.export_peft(s1, 0, tmp_path / "new", "base")
    with pytest.raises(OSError, match="disk full"):
        peft_io.export_peft(s1, 0, dest, "base")
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]  # nothing half-written, old one kept
    np.testing.assert_array_equal(np.asarray(peft_io.import_peft(dest, cfg).b["q_proj"][0]),
                                  np.asarray(s2.b["q_proj"][0]))


def test_import_errors_name_the_tensor(twin, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, _, cfg, _ = twin
    dest = peft_io.export_peft(random_stack(cfg, QV), 0, tmp_path / "a", "base")
    wfile = dest / "adapter_model.safetensors"
    good = load_file(str(wfile))
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"

    save_file({k: v for k, v in good.items() if k != key}, str(wfile))
    with pytest.raises(peft_io.AdapterError, match=f"missing tensor '{key}'"):
        peft_io.import_peft(dest, cfg)

    save_file({**good, key: np.zeros((3, 4), np.float32)}, str(wfile))
    with pytest.raises(peft_io.AdapterError, match=rf"'{key}' has shape \(3, 4\), expected \(32, 4\)"):
        peft_io.import_peft(dest, cfg)

    extra = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    save_file({**good, extra: np.zeros((4, 64), np.float32)}, str(wfile))
    with pytest.raises(peft_io.AdapterError, match="unexpected tensor.*mlp.up_proj.lora_A"):
        peft_io.import_peft(dest, cfg)

    conf = json.loads((dest / "adapter_config.json").read_text())
    (dest / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(peft_io.AdapterError, match="use_dora"):
        peft_io.import_peft(dest, cfg)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        peft_io.import_peft(tmp_path / "nope", cfg)
