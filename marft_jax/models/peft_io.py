"""Per-agent LoRA adapters <-> Hugging Face PEFT adapter folders.

Each agent's slice of a :class:`~marft_jax.models.lora.LoraStack` exports to a standard PEFT
LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained`` loads onto the HF base model, and imports back bit-exactly.

Tensor layout (PEFT stores ``nn.Linear`` weights ``[out, in]``)::

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight   [r, d_in]
    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_B.weight   [d_out, r]
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight

ours: ``a[t][agent, i] = lora_A.T`` (``[d_in, r]``), ``b[t][agent, i] = lora_B.T`` (``[r, d_out]``),
``scale = lora_alpha / r``. Exports are atomic: files go to a temporary sibling folder that is
renamed into place, so a failed export never leaves a half-written adapter.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from marft_jax.models.config import ModelConfig
from marft_jax.models.lora import TARGETS, LoraStack, module_dims

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers"


class AdapterError(ValueError):
    """A PEFT adapter folder does not match the model (names the file, key or tensor)."""


def peft_module_path(target: str) -> str:
    """``q_proj`` -> ``self_attn.q_proj``; ``gate_proj`` -> ``mlp.gate_proj``."""
    if target not in TARGETS:
        raise AdapterError(f"unknown LoRA target module {target!r}; supported: {list(TARGETS)}")
    return f"{'self_attn' if target in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{target}"


def peft_key(layer: int, target: str, factor: str) -> str:
    """The safetensors key of one factor (``"A"`` or ``"B"``) of one layer's adapter."""
    return f"{_PREFIX}.{layer}.{peft_module_path(target)}.lora_{factor}.weight"


def _alpha_value(alpha: float):
    return int(round(alpha)) if abs(alpha - round(alpha)) < 1e-9 else float(alpha)


def export_peft(lora_stack: LoraStack, agent: int, out_dir: str | Path, base_model_name: str) -> Path:
    """Write agent ``agent``'s adapter as a PEFT LoRA folder at ``out_dir`` (replaced atomically).

    Args:
      lora_stack: ``a[t]: [agent, layer, d_in, r]``, ``b[t]: [agent, layer, r, d_out]``.
      agent: which agent's slice to export.
      out_dir: destination folder (created; an existing adapter there is replaced).
      base_model_name: recorded as ``base_model_name_or_path``.
    Returns the folder path.
    """
    n = lora_stack.num_agents
    if not 0 <= int(agent) < n:
        raise IndexError(f"export_peft: agent {agent} out of range for a stack of {n} agents")
    agent = int(agent)
    ranks = {t: int(lora_stack.a[t].shape[-1]) for t in lora_stack.targets}
    if len(set(ranks.values())) != 1:
        raise AdapterError(f"export_peft: targets have different ranks {ranks}; PEFT needs one r")
    r = next(iter(ranks.values()))
    tensors: dict[str, np.ndarray] = {}
    for t in lora_stack.targets:
        a = np.asarray(lora_stack.a[t][agent], np.float32)  # [layer, d_in, r]
        b = np.asarray(lora_stack.b[t][agent], np.float32)  # [layer, r, d_out]
        for i in range(a.shape[0]):
            tensors[peft_key(i, t, "A")] = np.ascontiguousarray(a[i].T)
            tensors[peft_key(i, t, "B")] = np.ascontiguousarray(b[i].T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model_name),
        "r": r,
        "lora_alpha": _alpha_value(lora_stack.scale * r),
        "target_modules": list(lora_stack.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    return _write_atomically(Path(out_dir), config, tensors)


def _write_atomically(out: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    from safetensors.numpy import save_file

    if out.exists() and not out.is_dir():
        raise AdapterError(f"export_peft: {str(out)!r} exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    old = None
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)
                old = None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def read_adapter_config(adapter_dir: str | Path) -> dict:
    """``adapter_config.json`` validated for what we support (plain LoRA, bias none, one r)."""
    root = Path(adapter_dir)
    path = root / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{root}: no {CONFIG_FILE} (not a PEFT adapter folder)")
    try:
        c = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path}: invalid JSON ({e})") from e
    if c.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type {c.get('peft_type')!r} is not supported (only 'LORA')")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in c:
            raise AdapterError(f"{path}: missing {key!r}")
    if c.get("use_dora"):
        raise AdapterError(f"{path}: use_dora=True is not supported")
    if c.get("bias", "none") != "none" or c.get("lora_bias"):
        raise AdapterError(f"{path}: bias={c.get('bias')!r} is not supported (only 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if c.get(key):
            raise AdapterError(f"{path}: {key} {c[key]!r} is not supported (one r and alpha for all)")
    for key in ("layers_to_transform", "modules_to_save", "layer_replication"):
        if c.get(key):
            raise AdapterError(f"{path}: {key}={c[key]!r} is not supported")
    targets = c["target_modules"]
    if isinstance(targets, str):
        targets = [targets]
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise AdapterError(f"{path}: target_modules {bad} not supported; choose from {list(TARGETS)}")
    c["target_modules"] = [t for t in TARGETS if t in targets]  # canonical order
    return c


def import_peft(adapter_dir: str | Path, cfg: ModelConfig) -> LoraStack:
    """Read a PEFT LoRA folder into a one-agent :class:`LoraStack` (leading agent axis of size 1).

    Raises :class:`AdapterError` naming the key for a missing, unexpected or misshapen tensor.
    """
    from safetensors.numpy import load_file

    root = Path(adapter_dir)
    c = read_adapter_config(root)
    r = int(c["r"])
    alpha = float(c["lora_alpha"])
    scale = alpha / math.sqrt(r) if c.get("use_rslora") else alpha / r
    wfile = root / WEIGHTS_FILE
    if not wfile.is_file():
        raise FileNotFoundError(f"{root}: no {WEIGHTS_FILE}")
    tensors = load_file(str(wfile))
    expected: set[str] = set()
    a_out, b_out = {}, {}
    for t in c["target_modules"]:
        d_in, d_out = module_dims(cfg, t)
        a_layers, b_layers = [], []
        for i in range(cfg.num_layers):
            for factor, want, dest in (("A", (r, d_in), a_layers), ("B", (d_out, r), b_layers)):
                key = peft_key(i, t, factor)
                expected.add(key)
                if key not in tensors:
                    raise AdapterError(f"{wfile}: missing tensor {key!r}")
                arr = tensors[key]
                if tuple(arr.shape) != want:
                    raise AdapterError(f"{wfile}: tensor {key!r} has shape {tuple(arr.shape)}, "
                                       f"expected {want} (r={r}, model {cfg.arch} "
                                       f"hidden={cfg.hidden_size}, layers={cfg.num_layers})")
                dest.append(np.ascontiguousarray(arr.astype(np.float32).T))
        a_out[t] = jnp.asarray(np.stack(a_layers)[None])  # [1, layer, d_in, r]
        b_out[t] = jnp.asarray(np.stack(b_layers)[None])  # [1, layer, r, d_out]
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise AdapterError(f"{wfile}: unexpected tensor(s) {unexpected[:5]}"
                           f"{' …' if len(unexpected) > 5 else ''} (not in target_modules "
                           f"{c['target_modules']} for {cfg.num_layers} layers)")
    return LoraStack(a=a_out, b=b_out, scale=scale)


def put_agent_adapter(stack: LoraStack, agent: int, adapter: LoraStack) -> LoraStack:
    """A new stack with slot ``agent`` replaced by a one-agent ``adapter`` (same targets, r, scale)."""
    if adapter.num_agents != 1:
        raise ValueError(f"put_agent_adapter: expected a one-agent adapter, got {adapter.num_agents} agents")
    if not 0 <= int(agent) < stack.num_agents:
        raise IndexError(f"put_agent_adapter: agent {agent} out of range for {stack.num_agents} agents")
    if set(adapter.targets) != set(stack.targets):
        raise ValueError(f"put_agent_adapter: adapter targets {list(adapter.targets)} differ from "
                         f"the stack's {list(stack.targets)}")
    if not math.isclose(adapter.scale, stack.scale, rel_tol=1e-6):
        raise ValueError(f"put_agent_adapter: adapter scale {adapter.scale} (alpha/r) differs from "
                         f"the stack's {stack.scale}")
    a, b = dict(stack.a), dict(stack.b)
    for t in stack.targets:
        for name, dst, src in (("lora_A", a, adapter.a[t]), ("lora_B", b, adapter.b[t])):
            if src.shape[1:] != dst[t].shape[1:]:
                raise ValueError(f"put_agent_adapter: {t}.{name} has shape {tuple(src.shape[1:])}, "
                                 f"the stack expects {tuple(dst[t].shape[1:])}")
            dst[t] = dst[t].at[int(agent)].set(src[0].astype(dst[t].dtype))
    return LoraStack(a=a, b=b, scale=stack.scale)
