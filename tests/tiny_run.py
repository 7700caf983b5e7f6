"""A tiny HF model directory with the embedded SmolLM2 tokenizer, for trainer/CLI tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TINY_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu",
}


def make_tiny_model_dir(root: Path) -> Path:
    """Write config.json, model.safetensors (random) and the embedded tokenizer to ``root``."""
    from safetensors.numpy import save_file

    from marft_jax.models import gguf_loader, registry
    from marft_jax.models.config import ModelConfig
    from marft_jax.models.weights import expected_shapes

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(TINY_CONFIG))
    cfg = ModelConfig.from_hf(TINY_CONFIG)
    rng = np.random.default_rng(0)
    tensors = {name: (1.0 + 0.1 * rng.standard_normal(shape) if "norm" in name
                      else 0.2 * rng.standard_normal(shape)).astype(np.float32)
               for name, shape in expected_shapes(cfg).items()}
    save_file(tensors, str(root / "model.safetensors"))
    tok = gguf_loader.gguf_tokenizer(registry.embedded_gguf_path())
    tok.save_pretrained(str(root))
    return root


def tiny_overrides(model_dir: Path, out_dir: Path, run_name: str, **extra) -> list[str]:
    base = {
        "model.name": str(model_dir), "rollout.rows": 2, "rollout.max_new_tokens": 6,
        "rollout.agent_max_new_tokens": "null",
        "rollout.context_window": 512, "train.iterations": 4, "train.eval_problems": 2,
        "train.save_every": 2, "train.scoring_workers": 0, "train.out_dir": str(out_dir),
        "train.run_name": run_name, "train.time_budget_s": "null", "task.train_size": 50,
        "task.test_size": 10, "ppo.epochs": 1, "ppo.num_minibatches": 1, "optim.policy_lr": 1e-3,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]
