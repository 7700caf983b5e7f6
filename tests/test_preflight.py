"""``marft-jax preflight`` (issue 37) and the table of known model architectures.

The command lowers a run's programs for an accelerator on the CPU with abstract weights; the
whole matrix of programs x lengths x attention x meshes is tests/test_lowering.py. Here: the
table's values, where the architecture comes from, and the command itself (a paper preset at
Qwen2.5-1.5B's real shapes for cuda x 1, the re-run with 8 simulated devices for tpu, a failure
naming the key to change).
"""

from __future__ import annotations

import json

import jax
import pytest

from marft_jax import cli, preflight
from marft_jax.models import known_configs
from marft_jax.models.config import ModelConfig
from tests.lowering_cases import TINY_MODEL

# Total parameters from the model cards (billions): huggingface.co/<name>.
PUBLISHED_PARAMS = {
    "Qwen/Qwen2.5-0.5B-Instruct": 0.49, "Qwen/Qwen2.5-1.5B-Instruct": 1.54, "Qwen/Qwen2.5-3B-Instruct": 3.09,
    "Qwen/Qwen2.5-7B-Instruct": 7.61, "HuggingFaceTB/SmolLM2-135M-Instruct": 0.135, "Qwen/Qwen3-0.6B": 0.6,
    "Qwen/Qwen3-1.7B": 1.7, "Qwen/Qwen3-4B": 4.0, "Qwen/Qwen3-8B": 8.2, "meta-llama/Llama-3.2-1B-Instruct": 1.23,
    "meta-llama/Llama-3.2-3B-Instruct": 3.21, "meta-llama/Llama-3.1-8B-Instruct": 8.03,
}
PAPER = "paper/math-duo-marft-a-qwen2.5-1.5b"


def test_known_configs_match_the_published_models():
    assert set(known_configs.NAMES) == set(PUBLISHED_PARAMS)
    for name, billions in PUBLISHED_PARAMS.items():
        cfg = ModelConfig.from_hf(known_configs.hf_config(name))
        assert cfg.num_params() / 1e9 == pytest.approx(billions, rel=0.02), name
    tied = {n: known_configs.hf_config(n)["tie_word_embeddings"] for n in PUBLISHED_PARAMS if "Qwen2.5" in n}
    assert tied == {"Qwen/Qwen2.5-0.5B-Instruct": True, "Qwen/Qwen2.5-1.5B-Instruct": True,
                    "Qwen/Qwen2.5-3B-Instruct": True, "Qwen/Qwen2.5-7B-Instruct": False}
    q15 = ModelConfig.from_hf(known_configs.hf_config("qwen2.5-1.5b-INSTRUCT"))   # basename, any case
    assert (q15.hidden_size, q15.num_layers, q15.num_heads, q15.num_kv_heads, q15.intermediate_size,
            q15.vocab_size, q15.rope_theta) == (1536, 28, 12, 2, 8960, 151936, 1e6)
    assert known_configs.hf_config("Qwen/Qwen2.5-1.5B") is None
    copy = known_configs.hf_config("Qwen/Qwen3-8B")
    copy["hidden_size"] = 1
    assert known_configs.hf_config("Qwen/Qwen3-8B")["hidden_size"] == 4096


def test_the_architecture_comes_from_a_directory_the_cache_or_the_table(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_MODEL))
    cfg, source = preflight.model_architecture(str(tmp_path / "model"))
    assert cfg.hidden_size == 128 and source.endswith("config.json")
    # The Hugging Face cache wins over the table (a checkpoint of that name as the user has it).
    snap = tmp_path / "hub" / "models--Qwen--Qwen2.5-1.5B-Instruct"
    (snap / "snapshots" / "abc").mkdir(parents=True)
    (snap / "refs").mkdir()
    (snap / "refs" / "main").write_text("abc")
    (snap / "snapshots" / "abc" / "config.json").write_text(
        json.dumps(dict(known_configs.hf_config("Qwen/Qwen2.5-1.5B-Instruct"), num_hidden_layers=3)))
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg, source = preflight.model_architecture("Qwen/Qwen2.5-1.5B-Instruct")
    assert cfg.num_layers == 3 and "Hugging Face cache" in source
    cfg, source = preflight.model_architecture("Qwen/Qwen2.5-3B-Instruct")      # not cached: the table
    assert cfg.num_layers == 36 and source == "marft_jax.models.known_configs"
    with pytest.raises(preflight.PreflightError, match="model.name='nobody/nothing'"):
        preflight.model_architecture("nobody/nothing")


def _in_process(monkeypatch, devices: int = 1):
    """Run the command in this process (it has the devices already; no re-run)."""
    monkeypatch.setenv(preflight.DEVICES_ENV, str(devices))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


def test_paper_preset_at_real_shapes_lowers_for_cuda(monkeypatch, capsys):
    """Qwen2.5-1.5B from the table, bf16, ``auto`` = cudnn: the prefill at every prompt bucket of a
    2,048-token window (the whole run's programs: ``marft-jax preflight`` without --programs)."""
    _in_process(monkeypatch)
    rc = cli.main(["preflight", PAPER, "model.name=Qwen/Qwen2.5-1.5B-Instruct", "--platform", "cuda",
                   "--devices", "1", "--programs", "prefill"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "from marft_jax.models.known_configs" in out and "attention cudnn" in out and "bfloat16" in out
    lines = [x for x in out.splitlines() if x.startswith("ok   prefill ") and "after prefix" not in x]
    assert [x.split()[4] for x in lines] == ["16", "32", "64", "128", "256", "384", "512", "640", "768", "896",
                                             "1024", "1280", "1536", "1792", "2048"]
    assert all("cudnn" in x for x in lines) and "all ok: 15 of 15" in out


def test_tpu_pod_check_reruns_itself_with_eight_devices(tmp_path, monkeypatch, capfd):
    (tmp_path / "config.json").write_text(json.dumps(TINY_MODEL))
    monkeypatch.delenv(preflight.DEVICES_ENV, raising=False)
    rc = cli.main(["preflight", PAPER, f"model.name={tmp_path}", "rollout.context_window=256",
                   "rollout.max_new_tokens=32", "rollout.rows=8", "--platform", "tpu", "--devices", "8",
                   "--programs", "prefill,decode"])
    out = capfd.readouterr().out
    assert rc == 0, out
    assert "tpu x 8 (mesh {'data': 8, 'fsdp': 1, 'tensor': 1})" in out and "attention splash" in out
    whole = [x for x in out.splitlines() if x.startswith("ok   prefill ") and "after prefix" not in x]
    assert [x.split()[4] for x in whole] == ["16", "32", "64", "128", "256"]
    # rollout.reuse_prefix: the prefill after a reused half of each bucket from 32 tokens on
    assert [x.split("->")[1].split()[0] for x in out.splitlines() if x.startswith("ok   prefill after prefix")] == [
        "32", "64", "128", "256"]
    assert sum(x.startswith("ok   decode") for x in out.splitlines()) >= 5 and "all ok" in out


def test_a_critic_free_run_lowers_its_backup_without_a_critic(tmp_path, monkeypatch, capsys):
    """algo.advantage=group: no critic in the abstract state, so the backup program alone (no feature
    pass), lowered for cuda."""
    _in_process(monkeypatch)
    (tmp_path / "config.json").write_text(json.dumps(TINY_MODEL))
    rc = cli.main(["preflight", PAPER, f"model.name={tmp_path}", "algo.advantage=group", "rollout.group_size=4",
                   "rollout.rows=8", "rollout.context_window=256", "rollout.max_new_tokens=32", "--platform", "cuda",
                   "--devices", "1", "--programs", "features+backup,backup"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    assert any(x.startswith("ok   backup") for x in lines) and not any("features+backup" in x for x in lines)
    assert "all ok" in out


def test_a_failure_names_the_key_and_stops(capsys):
    bad = preflight.Program("update", "rows 8", "ppo.micro_batches", jax.jit(lambda x: x.reshape(3)),
                            (jax.ShapeDtypeStruct((8,), "float32"),), {})
    good = preflight.Program("prefill", "8", "rollout.context_window", jax.jit(lambda x: x + 1),
                             (jax.ShapeDtypeStruct((8,), "float32"),), {})
    lines = []
    outcomes = preflight.run_programs(iter([good, bad, good]), "tpu", "xla", emit=lines.append)
    assert [o.error is None for o in outcomes] == [True, False]          # stopped at the failure
    assert lines[0].startswith("ok   prefill") and lines[1].startswith("FAIL update")
    assert "-> change ppo.micro_batches" in lines[1] and "TypeError" in lines[1]


def test_unknown_model_and_platform_mismatch_exit_2(monkeypatch, capsys):
    _in_process(monkeypatch)
    assert cli.main(["preflight", PAPER, "model.name=nobody/nothing", "--platform", "tpu"]) == 2
    assert "model.name='nobody/nothing'" in capsys.readouterr().err
    assert cli.main(["preflight", PAPER, "model.name=Qwen/Qwen2.5-1.5B-Instruct", "model.attention=splash",
                     "--platform", "cuda"]) == 2
    assert "model.attention='splash'" in capsys.readouterr().err


def test_the_run_code_traces_as_on_the_target_backend():
    """Per-backend choices made while tracing (here the backups' kernel: the CPU-only native
    FFI call on one CPU device, which jax.export refuses for TPU) follow --platform."""
    from marft_jax.rl import backups

    with preflight.as_backend("tpu"):
        assert jax.default_backend() == "tpu" and backups.resolve_impl("auto") == "associative"
    with preflight.as_backend("cuda"):
        assert jax.default_backend() == "gpu"
    assert jax.default_backend() == "cpu"
