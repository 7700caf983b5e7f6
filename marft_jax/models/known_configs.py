"""Architecture-only ``config.json`` dicts of the models our users run, keyed by Hub repo id.

They let code that needs a model's shapes but not its weights (``marft-jax preflight``, the
device check's random models, CI) work offline. Each dict holds the fields
:meth:`marft_jax.models.config.ModelConfig.from_hf` reads plus ``model_type``,
``architectures``, ``torch_dtype``, ``tie_word_embeddings``, ``vocab_size`` and the rope
fields, with the values of the repository's own ``config.json`` on the Hub (main branch).
Where each was checked is noted beside it. Whether a family is supported is decided by
:meth:`ModelConfig.from_hf` (Qwen3's q/k norm and Llama 3's ``llama3`` rope scaling are), not here.
"""

from __future__ import annotations

import copy
from typing import Any

_QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
          "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "bos_token_id": 151643, "eos_token_id": 151645, "max_position_embeddings": 32768,
          "sliding_window": 32768, "use_sliding_window": False, "attention_dropout": 0.0}
_QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_act": "silu",
          "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "rope_scaling": None, "bos_token_id": 151643, "eos_token_id": 151645,
          "max_position_embeddings": 40960, "attention_bias": False, "head_dim": 128,
          "vocab_size": 151936, "num_key_value_heads": 8, "sliding_window": None,
          "use_sliding_window": False, "attention_dropout": 0.0}
_LLAMA3 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
           "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "vocab_size": 128256, "max_position_embeddings": 131072, "attention_bias": False,
           "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
           "num_key_value_heads": 8, "attention_dropout": 0.0}


def _llama3_rope(factor: float) -> dict:
    return {"rope_scaling": {"factor": factor, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


_CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen2.5: huggingface.co/Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}-Instruct/blob/main/config.json,
    # checked against the model cards (layers, heads, tied embeddings) and
    # experiments/device_check.py's QWEN25_15B_SHAPE / experiments/memory_per_device.py (7B).
    "Qwen/Qwen2.5-0.5B-Instruct": {**_QWEN2, "hidden_size": 896, "intermediate_size": 4864,
                                   "num_hidden_layers": 24, "num_attention_heads": 14,
                                   "num_key_value_heads": 2, "max_window_layers": 21,
                                   "tie_word_embeddings": True, "vocab_size": 151936},
    "Qwen/Qwen2.5-1.5B-Instruct": {**_QWEN2, "hidden_size": 1536, "intermediate_size": 8960,
                                   "num_hidden_layers": 28, "num_attention_heads": 12,
                                   "num_key_value_heads": 2, "max_window_layers": 21,
                                   "tie_word_embeddings": True, "vocab_size": 151936},
    "Qwen/Qwen2.5-3B-Instruct": {**_QWEN2, "hidden_size": 2048, "intermediate_size": 11008,
                                 "num_hidden_layers": 36, "num_attention_heads": 16,
                                 "num_key_value_heads": 2, "max_window_layers": 70,
                                 "tie_word_embeddings": True, "vocab_size": 151936},
    "Qwen/Qwen2.5-7B-Instruct": {**_QWEN2, "hidden_size": 3584, "intermediate_size": 18944,
                                 "num_hidden_layers": 28, "num_attention_heads": 28,
                                 "num_key_value_heads": 4, "max_window_layers": 28,
                                 "sliding_window": 131072, "tie_word_embeddings": False,
                                 "vocab_size": 152064},
    # SmolLM2: huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json; the
    # shapes also match the embedded GGUF (models/registry.py) that the tests load.
    "HuggingFaceTB/SmolLM2-135M-Instruct": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
        "torch_dtype": "bfloat16", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": None,
        "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 8192,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 2},
    # Qwen3 (q/k RMSNorm, no q/k/v bias, head_dim 128): huggingface.co/Qwen/Qwen3-*/blob/main/
    # config.json; 0.6B-4B tie embeddings, 8B does not (model cards).
    "Qwen/Qwen3-0.6B": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072,
                        "num_hidden_layers": 28, "num_attention_heads": 16,
                        "max_window_layers": 28, "tie_word_embeddings": True},
    "Qwen/Qwen3-1.7B": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144,
                        "num_hidden_layers": 28, "num_attention_heads": 16,
                        "max_window_layers": 28, "tie_word_embeddings": True},
    "Qwen/Qwen3-4B": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728,
                      "num_hidden_layers": 36, "num_attention_heads": 32,
                      "max_window_layers": 36, "tie_word_embeddings": True},
    "Qwen/Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288,
                      "num_hidden_layers": 36, "num_attention_heads": 32,
                      "max_window_layers": 36, "tie_word_embeddings": False},
    # Llama 3.x (rope_type llama3): huggingface.co/meta-llama/<name>/blob/main/config.json;
    # the Instruct repos list three eos ids. 3.2 ties embeddings, 3.1-8B does not.
    "meta-llama/Llama-3.2-1B-Instruct": {**_LLAMA3, **_llama3_rope(32.0), "hidden_size": 2048,
                                         "intermediate_size": 8192, "num_hidden_layers": 16,
                                         "num_attention_heads": 32, "head_dim": 64,
                                         "tie_word_embeddings": True},
    "meta-llama/Llama-3.2-3B-Instruct": {**_LLAMA3, **_llama3_rope(32.0), "hidden_size": 3072,
                                         "intermediate_size": 8192, "num_hidden_layers": 28,
                                         "num_attention_heads": 24, "head_dim": 128,
                                         "tie_word_embeddings": True},
    "meta-llama/Llama-3.1-8B-Instruct": {**_LLAMA3, **_llama3_rope(8.0), "hidden_size": 4096,
                                         "intermediate_size": 14336, "num_hidden_layers": 32,
                                         "num_attention_heads": 32, "head_dim": 128,
                                         "tie_word_embeddings": False},
}

NAMES: tuple[str, ...] = tuple(_CONFIGS)


def hf_config(name: str) -> dict[str, Any] | None:
    """The ``config.json`` dict of a known model, or None.

    ``name`` is a Hub repo id (``"Qwen/Qwen2.5-1.5B-Instruct"``) or its bare basename
    (``"qwen2.5-1.5b-instruct"``), matched case-insensitively. The caller gets its own copy.
    """
    key = str(name).strip().lower()
    for repo, config in _CONFIGS.items():
        if key in (repo.lower(), repo.split("/", 1)[1].lower()):
            return copy.deepcopy(config)
    return None
