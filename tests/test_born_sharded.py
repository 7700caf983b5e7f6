"""HF checkpoints: bfloat16 safetensors load, and on a mesh the base weights are born sharded
(issue 16): each leaf is built from its devices' blocks, and each block is read alone from the
memory-mapped file, never the whole tensor."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.xla_env import device_env

ROOT = Path(__file__).resolve().parents[1]


def _save(tmp_path: Path, arch: str, dtype: str = "float32") -> Path:
    """A tiny random HF model saved with ``save_pretrained`` in ``dtype``; returns the folder."""
    pytest.importorskip("torch")
    import torch

    from tests.hf_tiny import tiny_hf_model

    model = tiny_hf_model(arch)
    model.to(getattr(torch, dtype)).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_bfloat16_checkpoint_loads_as_the_rounded_float32_one(tmp_path, arch):
    from marft_jax.models.weights import load_hf_checkpoint

    _, f32 = load_hf_checkpoint(_save(tmp_path / "f32", arch))
    _, bf16 = load_hf_checkpoint(_save(tmp_path / "bf16", arch, "bfloat16"))
    import jax
    import ml_dtypes

    for a, b in zip(jax.tree.leaves(f32), jax.tree.leaves(bf16), strict=True):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(b, a.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_safetensors_file_errors_name_the_file_and_tensor(tmp_path):
    from marft_jax.models.weights import CheckpointError, load_hf_checkpoint

    root = _save(tmp_path / "m", "llama")
    weights = root / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", 10 ** 9) + data[8:])          # a header longer than the file
    with pytest.raises(CheckpointError, match=r"model\.safetensors: header length"):
        load_hf_checkpoint(root)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = "model.norm.weight"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end + 4]                      # offsets that do not hold the shape
    raw = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        load_hf_checkpoint(root)


def test_wrong_shape_is_reported_before_anything_is_placed(tmp_path):
    from marft_jax.models.weights import CheckpointError, load_hf_checkpoint

    root = _save(tmp_path / "m", "qwen2")
    cfg = json.loads((root / "config.json").read_text())
    cfg["intermediate_size"] = 80                       # the stored MLP weights are 96 wide
    (root / "config.json").write_text(json.dumps(cfg))
    placed = []
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight.*has shape"):
        load_hf_checkpoint(root, place=lambda c, abstract: placed.append(1))
    assert not placed


def _child(model_dir: str) -> None:
    """On 4 simulated devices: load whole and born sharded on a (1, 2, 2) mesh; print JSON."""
    import jax

    from marft_jax.models import sharding, weights

    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2)
    reads: list[tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]] = []
    leaf_read = weights._Leaf.read

    def spy(self, get, index, dtype):           # every block read: (tensor, block shape, leaf shape)
        block = leaf_read(self, get, index, dtype)
        reads.append((self.names[0], block.shape, leaf_read(self, get, None, dtype).shape))
        return block

    _, whole = weights.load_hf_checkpoint(model_dir)
    weights._Leaf.read = spy
    _, born = weights.load_hf_checkpoint(model_dir, place=lambda cfg, a: sharding.param_shardings(a, mesh))
    weights._Leaf.read = leaf_read
    diffs = [float(np.abs(np.asarray(b) - a).max()) for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(born),
                                                                    strict=True)]
    specs = {"/".join(sharding.path_keys(p)): str(x.sharding.spec)
             for p, x in jax.tree_util.tree_leaves_with_path(born)}
    shard_shapes = {"/".join(sharding.path_keys(p)): list(x.sharding.shard_shape(x.shape))
                    for p, x in jax.tree_util.tree_leaves_with_path(born)}
    print(json.dumps({"max_diff": max(diffs), "specs": specs, "shard_shapes": shard_shapes,
                      "reads": [[n, list(b), list(w)] for n, b, w in reads]}))


@pytest.mark.multidevice
def test_base_weights_are_born_sharded_from_their_blocks(tmp_path):
    root = _save(tmp_path / "m", "qwen2")
    env = device_env(4)
    out = subprocess.run([sys.executable, "-c", f"from tests.test_born_sharded import _child; _child({str(root)!r})"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["max_diff"] == 0.0
    assert r["specs"]["layers/q_proj/kernel"] == "P(None, 'fsdp', 'tensor')", r["specs"]
    assert r["specs"]["layers/down_proj/kernel"] == "P(None, 'tensor', 'fsdp')", r["specs"]
    # 4 devices ask once each for their block of every leaf: a split leaf is read as quarters or
    # halves of it, never whole (a replicated one is whole by definition)
    by_tensor: dict[str, list] = {}
    for name, block, whole in r["reads"]:
        by_tensor.setdefault(name, []).append((block, whole))
    q = by_tensor["model.layers.0.self_attn.q_proj.weight"]
    assert len(q) == 4 and all(b == [2, 32, 32] and w == [2, 64, 64] for b, w in q), q
    assert all(b == [2, 48, 32] for b, _ in by_tensor["model.layers.0.mlp.down_proj.weight"])
    assert by_tensor["model.embed_tokens.weight"][0][0] == r["shard_shapes"]["embed"]
    assert sum(np.prod(b) for b, _ in q) == 4 * 2 * 64 * 64 // 4       # each device's quarter, once
