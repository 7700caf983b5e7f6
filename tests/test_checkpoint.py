"""Checkpoints (orbax CheckpointManager underneath): bit-exact round trip, rotation, atomic async
commit, integrity checks with fallback, disk-full and NaN safety, format-1 steps, restore onto
other meshes, two processes, PEFT export of every agent."""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from marft_jax.models.config import ModelConfig
from marft_jax.config import LoraConfig
from marft_jax.models.peft_io import import_peft
from marft_jax.config import OptimConfig
from marft_jax.rl.state import init_train_state
from marft_jax.train import checkpoint as ck
from marft_jax.train.checkpoint import (CheckpointCorruptError, CheckpointManager,
                                        CheckpointMismatchError, CheckpointSaveError, export_adapters)
from tests.xla_env import device_env

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(arch="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
N = 3


def _init(lora=LORA):
    return init_train_state(jax.random.key(0), CFG, lora, N, OptimConfig(), critic_lora=True)


def _abstract(lora=LORA):
    """A restore target without memory or compute (most tests restore into this)."""
    return jax.eval_shape(lambda: _init(lora))


def _perturb(state, seed: int):
    """Move every float leaf, the step and the key (on the host: no XLA compiles, which are
    slow on a loaded CPU), so nothing equals its initial value."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(state)
    out = []
    for x in leaves:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(x)) + np.uint32(seed + 1)
            out.append(jax.random.wrap_key_data(jnp.asarray(data), impl=jax.random.key_impl(x)))
        elif jnp.issubdtype(x.dtype, jnp.floating):
            h = np.asarray(x)
            out.append(jnp.asarray(h + rng.standard_normal(h.shape).astype(h.dtype)))
        else:
            out.append(jnp.asarray(np.asarray(x) + 3 + seed))
    return jax.tree.unflatten(treedef, out)


def _assert_bit_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)  # includes the static LoRA scale
    for (p, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jnp.issubdtype(y.dtype, jax.dtypes.prng_key), p
            assert jax.random.key_impl(x) == jax.random.key_impl(y)
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(p)
        assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(p)


@pytest.fixture(scope="module")
def states():
    base = _init()
    return [_perturb(base, s) for s in range(5)]


def _state_files(step_dir: Path) -> list[Path]:
    return sorted(p for p in (step_dir / ck.STATE_DIR).rglob("*") if p.is_file() and p.stat().st_size > 0)


def test_round_trip_bit_identical(tmp_path, states):
    st = states[1]
    extra = {"data_pos": 17, "config": {"ppo": {"epochs": 2}}, "metrics": {"episode/accuracy": np.float32(0.5)}}
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as mgr:
        assert mgr.save(5, st, extra)
        assert mgr.all_steps() == [5] and mgr.latest_step() == 5 and mgr.latest_step(verify=True) == 5
        out, got_extra = mgr.restore(target_state=states[4])  # a concrete target
        _assert_bit_identical(st, out)
        assert got_extra == {"data_pos": 17, "config": {"ppo": {"epochs": 2}}, "metrics": {"episode/accuracy": 0.5}}
        # An abstract target (no memory for a second copy) restores the same bits.
        out2, _ = mgr.restore(5, target_state=_abstract())
        _assert_bit_identical(st, out2)
    # Only the trainable state: the step dir holds orbax's three items and our manifest (and
    # orbax's own step metadata / commit marker).
    step_dir = tmp_path / "ckpt" / "step_00000005"
    names = {p.name for p in step_dir.iterdir()}
    assert {*ck.ITEMS, ck.MANIFEST_FILE} <= names and not names - {*ck.ITEMS, ck.MANIFEST_FILE,
                                                                  "_CHECKPOINT_METADATA", "commit_success.txt"}
    manifest = json.loads((step_dir / ck.MANIFEST_FILE).read_text())
    assert "extra/metadata" in manifest["files"] and any(f.startswith("state/") for f in manifest["files"])


def test_async_save_is_atomic_and_wait_commits(tmp_path, states, monkeypatch):
    """orbax writes the step into a ``*.orbax-checkpoint-tmp`` dir and renames it after our
    manifest, so a reader never sees an uncommitted step."""
    gate, entered = threading.Event(), threading.Event()
    real = ck.write_manifest

    def slow_manifest(step_dir, step):
        entered.set()
        assert gate.wait(30)
        return real(step_dir, step)

    monkeypatch.setattr(ck, "write_manifest", slow_manifest)
    mgr = CheckpointManager(tmp_path, keep_last=None, async_save=True)
    assert mgr.save(1, states[0], {"i": 1})
    assert entered.wait(30)
    names = [p.name for p in tmp_path.iterdir()]
    assert mgr.all_steps() == [] and mgr.latest_step() is None
    assert len(names) == 1 and names[0].startswith("step_00000001.orbax-checkpoint-tmp"), names
    # Every item is complete by now (orbax renamed each item's own tmp dir).
    assert {p.name for p in (tmp_path / names[0]).iterdir() if p.is_dir()} == set(ck.ITEMS)
    gate.set()
    mgr.wait()
    assert mgr.all_steps() == [1] and [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
    out, extra = mgr.restore(target_state=_abstract())
    _assert_bit_identical(states[0], out)
    assert extra == {"i": 1}
    mgr.close()


def test_keep_last_k_and_existing_step(tmp_path, states, caplog):
    with CheckpointManager(tmp_path, keep_last=2, async_save=True) as mgr:
        for s in range(1, 5):
            assert mgr.save(s * 10, states[s - 1], {"s": s})
        mgr.wait()
        assert mgr.all_steps() == [30, 40]
        with caplog.at_level(logging.WARNING, logger=ck.__name__):
            assert mgr.save(40, states[0]) is False
        assert "already exists" in caplog.text
        assert mgr.save(40, states[0], {"s": "forced"}, force=True)
        mgr.wait()
        out, extra = mgr.restore(40, target_state=_abstract())
        _assert_bit_identical(states[0], out)
        assert extra == {"s": "forced"} and mgr.all_steps() == [30, 40]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_corrupt_file_refused_kept_and_fallback(tmp_path, states):
    mgr = CheckpointManager(tmp_path, keep_last=5, async_save=False)
    for s in (1, 2, 3):
        mgr.save(s, states[s], {"s": s})
    victim = _state_files(tmp_path / "step_00000003")[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=victim.name) as ei:
        mgr.restore(3, target_state=_abstract())
    assert "sha256" in str(ei.value) and str(victim) in str(ei.value)
    with pytest.warns(RuntimeWarning, match="skipping corrupt checkpoint step 3"):
        out, extra = mgr.restore(target_state=_abstract())
    _assert_bit_identical(states[2], out)
    assert extra == {"s": 2}
    assert mgr.all_steps() == [1, 2, 3] and mgr.latest_step(verify=True) == 2  # nothing deleted
    # Training resumed from step 2 saves step 3 again: the corrupt copy is replaced, not kept.
    assert mgr.save(3, states[4], {"s": "new"})
    out, extra = mgr.restore(target_state=_abstract())
    _assert_bit_identical(states[4], out)
    assert extra == {"s": "new"}
    # A deleted file is named too.
    (tmp_path / "step_00000002" / ck.EXTRA_ITEM / "metadata").unlink()
    with pytest.raises(CheckpointCorruptError, match="extra/metadata.*missing"):
        mgr.restore(2, target_state=_abstract())
    out, _ = mgr.restore(1, target_state=_abstract())
    _assert_bit_identical(states[1], out)
    mgr.close()


def test_orbax_alone_misses_a_flipped_bit(tmp_path, states):
    """Why the manifest stays: orbax restores a flipped bit in the array data without an error.
    If this starts failing, orbax checks payloads itself and the manifest may go."""
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, states[0])
    state_dir = tmp_path / "step_00000001" / ck.STATE_DIR
    victim = max(_state_files(tmp_path / "step_00000001"), key=lambda p: p.stat().st_size)  # the chunk data
    original = victim.read_bytes()
    saveable, _ = ck._to_saveable(states[0])

    def restore_with_bit_flipped_at(offset):
        data = bytearray(original)
        data[offset] ^= 0x01
        victim.write_bytes(bytes(data))
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
            return reader.restore(state_dir.parent, ocp.args.Composite(**{ck.STATE_DIR: ocp.args.StandardRestore(
                jax.tree.map(ocp.utils.to_shape_dtype_struct, saveable))}))[ck.STATE_DIR]

    # The chunks' order in the file varies between runs; a flip that lands in a compressed
    # chunk's frame header is caught by the decompressor, one in the array payload is not.
    for offset in range(len(original) // 2, len(original), max(1, len(original) // 16)):
        try:
            got = restore_with_bit_flipped_at(offset)
            break
        except Exception as e:  # noqa: BLE001 - orbax raises a ValueError, or a bare Exception wrapping it
            if "decompress" not in f"{e} {e.__cause__} {e.__context__}".lower():
                raise
    else:
        pytest.fail("every flipped bit was caught by the decompressor")
    changed = [p for p, a, b in zip(jax.tree_util.tree_flatten_with_path(saveable)[0], jax.tree.leaves(saveable),
                                    jax.tree.leaves(got)) if np.asarray(a).tobytes() != np.asarray(b).tobytes()]
    assert len(changed) == 1, changed
    with CheckpointManager(tmp_path, async_save=False) as mgr, pytest.raises(CheckpointCorruptError, match="sha256"):
        mgr.restore(1, target_state=_abstract())


def test_partial_dir_without_manifest_refused(tmp_path, states):
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, states[0])
    partial = tmp_path / "step_00000009"
    shutil.copytree(tmp_path / "step_00000001", partial)
    (partial / ck.MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointCorruptError, match=f"step_00000009.*no {ck.MANIFEST_FILE}"):
        mgr.restore(9, target_state=_abstract())
    with pytest.warns(RuntimeWarning, match="step 9"):
        out, _ = mgr.restore(target_state=_abstract())
    _assert_bit_identical(states[0], out)
    assert partial.is_dir()
    shutil.rmtree(tmp_path / "step_00000001")
    with pytest.raises(CheckpointCorruptError, match="every checkpoint"), pytest.warns(RuntimeWarning):
        mgr.restore(target_state=_abstract())
    with pytest.raises(FileNotFoundError, match="no checkpoint step 4"):
        mgr.restore(4, target_state=_abstract())
    mgr.close()


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["manifest", "orbax", "async"])
def test_disk_full_keeps_previous_checkpoints(tmp_path, states, monkeypatch, where):
    mgr = CheckpointManager(tmp_path, keep_last=1, async_save=(where == "async"))
    assert mgr.save(1, states[0], {"s": 1})
    mgr.wait()
    if where == "orbax":  # the array writer fails after orbax created its tmp directories
        async def enospc_async(*a, **k):
            _enospc()

        monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", enospc_async)
    else:
        real = ck._write_file
        monkeypatch.setattr(ck, "_write_file", lambda p, d: _enospc() if p.name == ck.MANIFEST_FILE else real(p, d))
    with pytest.raises(CheckpointSaveError, match=r"step 2 failed: disk full \(ENOSPC\)") as ei:
        mgr.save(2, states[1], {"s": 2})
        mgr.wait()  # async: the failure surfaces here
    assert ei.value.errno == errno.ENOSPC
    monkeypatch.undo()
    # Nothing half-written is left, keep_last=1 did not rotate the good one out, and it restores.
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
    assert mgr.all_steps() == [1]
    out, extra = mgr.restore(target_state=_abstract())
    _assert_bit_identical(states[0], out)
    assert extra == {"s": 1}
    mgr.close()


def test_nonfinite_state_never_saved(tmp_path, states, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=1, async_save=True)
    assert mgr.save(1, states[0])
    bad = states[1].replace(lora=states[1].lora.replace(
        b={**states[1].lora.b, "v_proj": states[1].lora.b["v_proj"].at[1, 0, 0, 0].set(jnp.nan)}))
    with caplog.at_level(logging.ERROR, logger=ck.__name__):
        assert mgr.save(2, bad) is False
        assert mgr.save(1, bad, force=True) is False
    assert "non-finite" in caplog.text and "v_proj" in caplog.text
    mgr.wait()
    assert mgr.all_steps() == [1]
    out, _ = mgr.restore(target_state=_abstract())
    _assert_bit_identical(states[0], out)
    mgr.close()


def test_mismatched_target_is_not_corruption(tmp_path, states):
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, states[0])
    other = _abstract(LoraConfig(rank=2, alpha=8.0))
    with pytest.raises(CheckpointMismatchError, match="does not fit"):
        mgr.restore(target_state=other)
    rescaled = _abstract(LoraConfig(rank=4, alpha=4.0, targets=("q_proj", "v_proj")))
    with pytest.raises(CheckpointMismatchError, match="scale"):
        mgr.restore(target_state=rescaled)
    mgr.close()


KILLED_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    from marft_jax.train import checkpoint as ck
    mgr = ck.CheckpointManager(sys.argv[1], keep_last=1, async_save=True)
    mgr.save(1, {"w": np.arange(64, dtype=np.float32)}, {"s": 1})
    mgr.wait()

    def stuck(step_dir, step):  # every shard of step 2 is written; hang just before the commit
        print("COMMITTING", flush=True)
        time.sleep(600)

    ck.write_manifest = stuck
    mgr.save(2, {"w": np.arange(64, dtype=np.float32) + 1}, {"s": 2})
    mgr.wait()
""")


def test_process_killed_mid_save_keeps_previous_checkpoint(tmp_path):
    """SIGKILL during the commit of step 2 (keep_last=1): step 1 survives and restores, the
    leftover tmp dir is never listed, and the next manager removes it (in the background,
    done before its first save)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SCRIPT, str(tmp_path)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # the child is inside the commit (or died)
        assert ready, "the child did not reach the commit of step 2 within 120 s"
        line = proc.stdout.readline()
        assert line.strip() == "COMMITTING", line + proc.stderr.read()[-3000:]
    finally:
        proc.kill()
        proc.wait(timeout=60)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "step_00000001"]
    assert len(leftovers) == 1 and leftovers[0].startswith("step_00000002.orbax-checkpoint-tmp"), leftovers
    target = {"w": jax.ShapeDtypeStruct((64,), jnp.float32)}
    with CheckpointManager(tmp_path, read_only=True) as reader:  # e.g. `eval --run` beside a live run
        assert reader.all_steps() == [1] and reader.restore(target_state=target)[1] == {"s": 1}
        with pytest.raises(ValueError, match="read-only"):
            reader.save(5, {"w": jnp.zeros(64)})
    assert (tmp_path / leftovers[0]).is_dir()   # a reader never removes a writer's tmp dir
    with CheckpointManager(tmp_path, keep_last=1, async_save=False) as mgr:
        assert mgr.all_steps() == [1]
        out, extra = mgr.restore(target_state=target)
        np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(64, dtype=np.float32))
        assert extra == {"s": 1}
        assert mgr.save(3, out) and mgr.all_steps() == [3]
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000003"]
    for ro in (False, True):
        with CheckpointManager(tmp_path / "empty", read_only=ro) as mgr, \
                pytest.raises(FileNotFoundError, match="no checkpoint"):
            mgr.restore(target_state=out)


def test_format_1_checkpoint_still_restores(tmp_path, states):
    """A step written by the manager before orbax's (state/ + extra.json + meta.json + a manifest
    of all three) restores, and the run continues with format-2 steps beside it."""
    import hashlib

    step_dir = tmp_path / "step_00000004"
    saveable, impls = ck._to_saveable(states[3])
    with ocp.StandardCheckpointer() as w:
        w.save(step_dir / "state", saveable)
    meta = {"format": 1, "step": 4, "leaves": ck._leaf_specs(saveable), "key_impls": impls,
            "lora_scales": ck._lora_scales(states[3])}
    (step_dir / "meta.json").write_text(json.dumps(meta))
    (step_dir / "extra.json").write_text(json.dumps({"iteration": 4}))
    files = {p.relative_to(step_dir).as_posix(): {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                                                  "size": p.stat().st_size}
             for p in step_dir.rglob("*") if p.is_file()}
    (step_dir / ck.MANIFEST_FILE).write_text(json.dumps({"format": 1, "step": 4, "files": files}))
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.all_steps() == [4]
        out, extra = mgr.restore(target_state=_abstract())
        _assert_bit_identical(states[3], out)
        assert extra == {"iteration": 4}
        assert mgr.save(5, out, {"iteration": 5}) and mgr.all_steps() == [4, 5]
        (step_dir / "extra.json").write_text(json.dumps({"iteration": 3}))
        with pytest.raises(CheckpointCorruptError, match="extra.json.*(bytes|sha256)"):
            mgr.restore(4, target_state=_abstract())


def test_export_adapters_per_agent(tmp_path, states):
    st = states[2]
    paths = export_adapters(st, tmp_path / "adapters", "tiny-llama", roles=["planner", "coder", "critic/x"])
    assert [p.name for p in paths] == ["agent0_planner", "agent1_coder", "agent2_critic-x"]
    for i, p in enumerate(paths):
        back = import_peft(p, CFG)
        for t in LORA.targets:
            np.testing.assert_array_equal(np.asarray(back.a[t][0]), np.asarray(st.lora.a[t][i]))
            np.testing.assert_array_equal(np.asarray(back.b[t][0]), np.asarray(st.lora.b[t][i]))
    assert [p.name for p in export_adapters(st.lora, tmp_path / "anon", "tiny")] == ["agent0", "agent1", "agent2"]


# ----------------------------------------------------------------------------- other meshes, other processes

RESHARD_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from tests.test_checkpoint import _abstract, _host_leaves
    from marft_jax.train.checkpoint import CheckpointManager
    assert len(jax.devices()) == 8, jax.devices()
    want = np.load(sys.argv[2])
    want = [want[f"arr_{i}"] for i in range(len(want.files))]

    def spec_for(x, size, axis):  # shard the first dimension that the mesh axis divides
        dims = [i for i, n in enumerate(getattr(x, "shape", ())) if n % size == 0]
        return P(*([None] * dims[0] + [axis])) if dims else P()

    def same(tree):
        got = _host_leaves(tree)
        assert len(got) == len(want) and all(g.dtype == w.dtype and g.tobytes() == w.tobytes()
                                             for g, w in zip(got, want))

    mesh8 = Mesh(np.array(jax.devices()), ("x",))
    sh8 = jax.tree.map(lambda x: NamedSharding(mesh8, spec_for(x, 8, "x")), _abstract())
    with CheckpointManager(sys.argv[1], keep_last=None, async_save=True) as mgr:
        # Step 1 was saved by a one-device process: restore it sharded over 8 devices.
        out, _ = mgr.restore(1, target_state=_abstract(), shardings=sh8)
        same(out)
        for x, s in zip(jax.tree.leaves(out), jax.tree.leaves(sh8)):
            assert x.sharding == s, (x.sharding, s)
        assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
                   for x in jax.tree.leaves(out))
        # Save from the 8-device mesh; restore onto another mesh (2 x 4), as abstract targets.
        mgr.save(2, out, {"from": "8 devices"})
        mesh24 = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
        tgt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                          sharding=NamedSharding(mesh24, spec_for(x, 4, "b"))),
                           _abstract())
        out, extra = mgr.restore(2, target_state=tgt)
        same(out)
        assert extra == {"from": "8 devices"}
        assert all(x.sharding == t.sharding for x, t in zip(jax.tree.leaves(out), jax.tree.leaves(tgt)))
    print("OK")
""")


def _host_leaves(tree) -> list[np.ndarray]:
    """Every leaf as a host array (PRNG keys as their uint32 data)."""
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(tree)]


@pytest.mark.multidevice
def test_restore_reshards_between_1_and_8_devices(tmp_path, states):
    """A step saved on 1 device restores sharded on 8 (and on a 2x4 mesh), and a step saved
    sharded on 8 restores onto this process's single device, bit-identical each time."""
    with CheckpointManager(tmp_path / "ckpt", keep_last=None, async_save=False) as mgr:
        mgr.save(1, states[1])
    np.savez(tmp_path / "want.npz", *_host_leaves(states[1]))
    env = device_env(8)
    out = subprocess.run([sys.executable, "-c", RESHARD_SCRIPT, str(tmp_path / "ckpt"), str(tmp_path / "want.npz")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-4000:]
    with CheckpointManager(tmp_path / "ckpt", keep_last=None, async_save=False) as mgr:
        assert mgr.all_steps() == [1, 2]
        back, extra = mgr.restore(target_state=_abstract())
    _assert_bit_identical(states[1], back)
    assert extra == {"from": "8 devices"}
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(back))


MULTIPROCESS_SCRIPT = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    proc, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    # CPU collectives across processes: gloo, jax's default since 0.5 (needed by the finite check).
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=proc,
                               initialization_timeout=60)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from marft_jax.train.checkpoint import CheckpointManager
    assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("proc", "dev"))
    row = NamedSharding(mesh, P(("proc", "dev")))          # each process holds half of the rows
    col = NamedSharding(mesh, P(None, "proc"))             # another layout: columns split
    want = {"w": np.arange(8 * 6, dtype=np.float32).reshape(8, 6), "step": np.int32(7),
            "key": np.asarray(jax.random.key_data(jax.random.key(3)))}

    def build(tree, shard):
        return {k: jax.make_array_from_callback(v.shape, shard if v.ndim == 2 else NamedSharding(mesh, P()),
                                                lambda idx, v=v: v[idx]) for k, v in tree.items()}

    def check(got, ref, shard):
        for k, v in ref.items():
            assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
            if v.ndim == 2:
                assert got[k].sharding == shard, (k, got[k].sharding)
            for s in got[k].addressable_shards:               # this process's pieces only
                np.testing.assert_array_equal(np.asarray(s.data), v[s.index], err_msg=k)

    state = build(want, row)
    with CheckpointManager(directory, keep_last=2, async_save=True) as mgr:
        assert mgr.save(1, state, {"iteration": 1})
        mgr.wait()
        # Resume: restore (onto the other layout), update, save again, restore.
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=col if v.ndim == 2 else NamedSharding(mesh, P()))
                  for k, v in want.items()}
        got, extra = mgr.restore(target_state=target)
        assert extra == {"iteration": 1}, extra
        check(got, want, col)
        want2 = dict(want, w=want["w"] * 2 + 1, step=np.int32(8))
        assert mgr.save(2, build(want2, col), {"iteration": 2})
    with CheckpointManager(directory, keep_last=2, async_save=False) as mgr:
        assert mgr.all_steps() == [1, 2], mgr.all_steps()
        got, extra = mgr.restore(target_state=build(want, row))  # concrete target: its shardings
        assert extra == {"iteration": 2}
        check(got, want2, row)
    print(f"OK process {proc}", flush=True)
""")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multidevice
def test_two_processes_save_restore_resume(tmp_path):
    """Two jax.distributed processes on localhost (2 CPU devices each) save one sharded array
    pytree (each writes its shards, orbax barriers), restore it onto another layout, and resume."""
    env = device_env(None)
    port = _free_port()
    logs = [open(tmp_path / f"process{i}.log", "w+") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", MULTIPROCESS_SCRIPT, str(i), str(port), str(tmp_path / "ckpt")],
                              env=env, cwd=ROOT, stdout=logs[i], stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    deadline, timed_out = time.monotonic() + 120, False
    try:
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for f in logs:
        f.seek(0)
        texts.append(f.read())
        f.close()
    report = "\n".join(f"--- process {i} (rc {p.returncode}) ---\n{t[-3000:]}" for i, (p, t) in enumerate(zip(procs, texts)))
    assert not timed_out, "a process did not finish within 120 s (killed)\n" + report
    assert all(p.returncode == 0 for p in procs) and all(f"OK process {i}" in t for i, t in enumerate(texts)), report
    step = tmp_path / "ckpt" / "step_00000002"
    assert (step / ck.MANIFEST_FILE).is_file() and not list((tmp_path / "ckpt").glob("*tmp*"))
    ck.verify_manifest(step)
