"""Sampler throughput: our jitted sampler vs Hugging Face ``generate`` (PyTorch), one run.

Prints ONE JSON object. Both sides run the same weights on the same left-padded prompts, sample
at temperature 1.0 with top-k/top-p off and EOS disabled, so each row generates exactly
``--new-tokens`` tokens. Throughput is generated tokens per second of wall time (prefill
included). The CPU matmul roofline is measured in the same run (a large float32 matmul), and
our decode FLOP/s is ``ModelConfig.flops_per_token(mean context) × tokens/s``.

Sections of the JSON:

* ``per_batch``: short prompts (``--prompt-len``, lengths in ``[len/2, len]``) at
  ``--batch-sizes`` (skipped with ``--batch-sizes ''``).
* ``per_prompt_len``: realistic lengths, ``{"512": {"4": {..., "ratio_ours_over_hf": x}, ...}}``
  for ``--prompt-lens`` x ``--batches`` (lengths in ``[0.8 len, len]``); every entry carries the
  jnp and torch float32 matmul rooflines measured right before it (the machine is shared: the
  roofline says how loaded it was).
* ``per_step``: our (and HF's) decode-step cost at ~800- and ~32-token contexts (batch
  ``--step-batch``), and ``per_step_ratio_800_over_32`` (target <= 1.5); per context the
  floor ``floor_ms``, the larger of ``bandwidth_floor_ms`` (the weights once, as the step reads
  them: float32, or the GGUF blocks with ``--decode-weights native``, plus each row's float32
  K/V, at the best of two ``jnp.sum`` read-bandwidth measurements around the steps,
  ``read_bytes_per_s``) and ``compute_floor_ms`` (the rows' ``flops_per_token`` at the matmul
  roofline), and ``ours_over_floor``.

Usage::

    python -m marft_jax.bench.sampler --model smollm2-135m      # the embedded checkpoint
    python -m marft_jax.bench.sampler --model tiny              # random weights, same shape
    python -m marft_jax.bench.sampler --model tiny --batch-sizes '' --prompt-lens 512 \
        --batches 4 --new-tokens 32 --repeats 1                 # one quick point
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.bench.machine import torch_matmul_flops
from marft_jax.models import cache_attention, causal_attention, decoder, layer_matmul, quant_matmul
from marft_jax.models.config import ModelConfig
from marft_jax.sampling.buckets import length_bucket
from marft_jax.sampling.sampler import Sampler, SamplingConfig, decode_weight_bytes

# SmolLM2-135M's shape (random weights are fine for a speed measurement).
SMOLLM2_135M_SHAPE = dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                          max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,))


def tiny_model(seed: int = 0) -> tuple[ModelConfig, dict]:
    """A random model with the SmolLM2-135M shape (float32)."""
    cfg = ModelConfig(**SMOLLM2_135M_SHAPE)
    return cfg, decoder.init_params(jax.random.key(seed), cfg)


def load(name: str) -> tuple[ModelConfig, dict, dict | None]:
    """``(config, float32 params, the GGUF blocks or None)`` of ``name``."""
    if name == "tiny":
        return (*tiny_model(), None)
    from marft_jax.models.registry import load_model

    m = load_model(name, dtype=jnp.float32)
    return m.cfg, m.params, m.quantized


def hf_model_from_params(cfg: ModelConfig, params: dict):
    """The same model as a ``transformers`` PyTorch module (float32, eval mode, SDPA attention)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                  tie_word_embeddings=cfg.tie_word_embeddings,
                  max_position_embeddings=cfg.max_position_embeddings, pad_token_id=0)
    if cfg.arch == "qwen2":
        hf_cfg = Qwen2Config(**common)
    else:
        hf_cfg = LlamaConfig(attention_bias=cfg.qkv_bias, **common)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    np_params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    sd: dict[str, Any] = {"model.embed_tokens.weight": np_params["embed"],
                          "model.norm.weight": np_params["final_norm"]}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = np_params["lm_head"].T
    names = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj"}
    layers = np_params["layers"]
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        sd[pre + "input_layernorm.weight"] = layers["input_norm"][i]
        sd[pre + "post_attention_layernorm.weight"] = layers["post_norm"][i]
        for ours, theirs in names.items():
            sd[pre + theirs + ".weight"] = layers[ours]["kernel"][i].T
            if "bias" in layers[ours]:
                sd[pre + theirs + ".bias"] = layers[ours]["bias"][i]
    state = {k: torch.from_numpy(np.array(v, np.float32, copy=True, order="C")) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"HF state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int, min_frac: float = 0.5) -> list[list[int]]:
    """Random prompts with lengths in ``[prompt_len * min_frac, prompt_len]``."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(max(int(prompt_len * min_frac), 1), prompt_len + 1, batch)
    return [rng.integers(3, vocab, n).tolist() for n in lens]


def matmul_roofline_flops(n: int = 3072, repeats: int = 5) -> float:
    """Best float32 FLOP/s of an ``n x n @ n x n`` jnp matmul on this machine."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    jax.block_until_ready(mm(a, b))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(mm(a, b))
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def decode_step_s(cfg, params, batch: int, prompt_len: int, new_tokens: int, seed: int, repeats: int) -> float:
    """Our decode-step wall time at a ``prompt_len`` context: one phase (cache of
    ``prompt_bucket + new_tokens`` slots) timed apart from the prefill, best of ``repeats``."""
    from marft_jax.sampling import buckets
    from marft_jax.sampling import sampler as smp

    prompts = make_prompts(batch, prompt_len, cfg.vocab_size, seed, min_frac=1.0)
    pb = buckets.pad_prompts(prompts, fine_above=256)
    best = float("inf")
    for r in range(repeats + 1):                                           # the first compiles
        state = smp.prefill(params, None, jnp.asarray(pb.tokens), jnp.asarray(pb.valid),
                            jnp.asarray(pb.active), jnp.int32(0), jnp.asarray(smp.stop_id_array([])),
                            jax.random.key(seed + r), smp.SamplingParams.make(1.0), jnp.int32(new_tokens),
                            jnp.int32(0), cfg=cfg, max_new_tokens=new_tokens)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state = smp.decode(params, None, state, jnp.int32(-1), cfg=cfg)
        jax.block_until_ready(state)
        if r:
            best = min(best, (time.perf_counter() - t0) / (new_tokens - 1))
    return best


class OursRunner:
    """Our sampler on fixed prompts; EOS disabled (empty stop set) so every row runs to the budget."""

    def __init__(self, cfg, params, prompts, new_tokens: int, seed: int, quantized: dict | None = None):
        self.cfg, self.params, self.prompts = cfg, params, prompts
        self.new_tokens, self.seed = new_tokens, seed
        self.sampler = Sampler(cfg, pad_id=0, stop_ids=(), quantized=quantized)
        self.config = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, top_k=0, top_p=1.0)
        self.calls = 0

    def __call__(self) -> float:
        """Wall seconds of one call (the first call includes compilation)."""
        t0 = time.perf_counter()
        key = jax.random.key(self.seed + self.calls)
        out = self.sampler(self.params, self.prompts, key=key, config=self.config)
        dt = time.perf_counter() - t0
        self.calls += 1
        assert (out.lengths == self.new_tokens).all(), out.lengths
        return dt


class HFRunner:
    """``model.generate`` on the same left-padded prompts, sampling, EOS disabled."""

    def __init__(self, model, prompts, new_tokens: int, seed: int):
        import torch

        length = max(len(p) for p in prompts)
        ids = np.zeros((len(prompts), length), np.int64)
        mask = np.zeros((len(prompts), length), np.int64)
        for i, p in enumerate(prompts):
            ids[i, length - len(p):] = p
            mask[i, length - len(p):] = 1
        self.model, self.new_tokens, self.seed, self.length = model, new_tokens, seed, length
        self.ids, self.mask = torch.from_numpy(ids), torch.from_numpy(mask)
        self.calls = 0

    def __call__(self, new_tokens: int | None = None) -> float:
        import torch

        n = self.new_tokens if new_tokens is None else new_tokens
        torch.manual_seed(self.seed + self.calls)
        self.calls += 1
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      eos_token_id=None, pad_token_id=0)
            dt = time.perf_counter() - t0
        assert out.shape[1] == self.length + n, out.shape
        return dt


def _compare(cfg, params, hf_model, prompts, new_tokens: int, seed: int, repeats: int,
             flops_per_token: float, roofline: float, quantized: dict | None = None) -> dict[str, Any]:
    """One point: ours vs HF generate on the same prompts, interleaved runs, best of each."""
    bs = len(prompts)
    ours = OursRunner(cfg, params, prompts, new_tokens, seed, quantized)
    first = ours()                                                         # compile + run
    hf = HFRunner(hf_model, prompts, new_tokens, seed) if hf_model is not None else None
    if hf is not None:
        hf(new_tokens=2)                                                   # warm-up
    ours_s, hf_s = [], []
    for _ in range(repeats):                                               # interleaved: same load
        ours_s.append(ours())
        if hf is not None:
            hf_s.append(hf())
    ours_tps = bs * new_tokens / min(ours_s)
    row: dict[str, Any] = {
        "ours_tokens_per_s": ours_tps,
        "ours_compile_s": max(first - min(ours_s), 0.0),
        "ours_run_s": min(ours_s),
        "ours_decode_gflops": flops_per_token * ours_tps / 1e9,
        "ours_roofline_fraction": flops_per_token * ours_tps / roofline,
    }
    if hf is not None:
        hf_tps = bs * new_tokens / min(hf_s)
        row.update({"hf_tokens_per_s": hf_tps, "hf_run_s": min(hf_s), "ratio_ours_over_hf": ours_tps / hf_tps})
    return row


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="'smollm2-135m', 'tiny', an HF dir or a .gguf")
    p.add_argument("--batch-sizes", default="8,32", help="per_batch section ('' to skip)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32, help="per_batch prompt length")
    p.add_argument("--prompt-lens", default="512,1024", help="per_prompt_len section ('' to skip)")
    p.add_argument("--batches", default="4,8,32", help="batch sizes of the per_prompt_len section")
    p.add_argument("--step-contexts", default="32,800", help="per_step contexts ('' to skip); "
                   "per_step_ratio_800_over_32 needs 32 and 800")
    p.add_argument("--step-batch", type=int, default=4)
    p.add_argument("--step-new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per side (best is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--decode-attention", default="auto", choices=["auto", "xla", "native"],
                   help="our attention over the KV cache (model.decode_attention)")
    p.add_argument("--decode-matmul", default="auto", choices=["auto", "xla", "native"],
                   help="our decode steps' projections (model.decode_matmul)")
    p.add_argument("--decode-weights", default="auto", choices=["auto", "dequantized", "native"],
                   help="our decode steps read a GGUF file's blocks (model.decode_weights)")
    p.add_argument("--causal-attention", default="auto", choices=["auto", "xla", "native"],
                   help="our prefills' whole-row attention (model.causal_attention)")
    args = p.parse_args(argv)

    cores = os.cpu_count() or 1
    # OpenMP threads that spin-wait collapse when the CPU is shared (a 2-core box running other
    # jobs): passive waiting keeps the PyTorch baseline fair. Only effective before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    load_start = os.getloadavg()[0]
    cfg, params, quantized = load(args.model)
    cfg = dataclasses.replace(cfg, decode_attention=cache_attention.resolve(args.decode_attention, dtype=jnp.float32,
                                                                           key="--decode-attention"),
                              decode_matmul=layer_matmul.resolve(args.decode_matmul, dtype=jnp.float32,
                                                                 key="--decode-matmul"),
                              decode_weights=quant_matmul.resolve(args.decode_weights, quantized=quantized is not None,
                                                                  dtype=jnp.float32, key="--decode-weights"),
                              causal_attention=causal_attention.resolve(args.causal_attention, dtype=jnp.float32,
                                                                        key="--causal-attention"))
    quantized = quantized if cfg.decode_weights == "native" else None
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    roofline = matmul_roofline_flops()
    hf_model = None
    if not args.no_hf:
        import torch

        torch.set_num_threads(cores)
        hf_model = hf_model_from_params(cfg, params)

    context = length_bucket(args.prompt_len) + args.new_tokens / 2         # mean attended slots
    flops_per_token = cfg.flops_per_token(int(context))
    report: dict[str, Any] = {
        "bench": "sampler", "model": args.model, "backend": jax.default_backend(),
        "dtype": "float32", "decode_attention": cfg.decode_attention,
        "decode_matmul": cfg.decode_matmul, "decode_weights": cfg.decode_weights,
        "causal_attention": cfg.causal_attention, "cpu_cores": cores, "machine": platform.machine(),
        "torch_threads": cores if hf_model is not None else None,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "new_tokens": args.new_tokens, "prompt_len_max": args.prompt_len, "repeats": args.repeats,
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "eos": "disabled"},
        "tokens_per_s": "generated tokens / wall s of the whole call (prefill included), best run",
        "matmul_roofline_gflops": roofline / 1e9,
        "torch_matmul_roofline_gflops": torch_matmul_flops() / 1e9 if hf_model is not None else None,
        "flops_per_token_gflop": flops_per_token / 1e9,
        "per_batch": {},
    }
    for bs in _ints(args.batch_sizes):
        prompts = make_prompts(bs, args.prompt_len, cfg.vocab_size, args.seed + bs)
        report["per_batch"][str(bs)] = _compare(cfg, params, hf_model, prompts, args.new_tokens, args.seed,
                                                args.repeats, flops_per_token, roofline, quantized)

    report["per_prompt_len"] = {}
    for plen in _ints(args.prompt_lens):
        fpt = cfg.flops_per_token(int(0.9 * plen + args.new_tokens / 2))
        section = report["per_prompt_len"][str(plen)] = {}
        for bs in _ints(args.batches):
            jnp_roof = matmul_roofline_flops(2048, 3)
            torch_roof = torch_matmul_flops(2048, 3) if hf_model is not None else None
            prompts = make_prompts(bs, plen, cfg.vocab_size, args.seed + 1000 * plen + bs, min_frac=0.8)
            row = _compare(cfg, params, hf_model, prompts, args.new_tokens, args.seed, args.repeats, fpt, jnp_roof,
                           quantized)
            row.update({"prompt_lens_min_max": [min(map(len, prompts)), max(map(len, prompts))],
                        "jnp_matmul_roofline_gflops": jnp_roof / 1e9,
                        "torch_matmul_roofline_gflops": None if torch_roof is None else torch_roof / 1e9})
            section[str(bs)] = row

    contexts = _ints(args.step_contexts)
    if contexts:
        n = args.step_new_tokens
        from marft_jax.bench import floor
        from marft_jax.train.peaks import measured_read_bandwidth

        bandwidth = [measured_read_bandwidth()]
        steps: dict[str, Any] = {"batch": args.step_batch, "new_tokens": n,
                                 "jnp_matmul_roofline_gflops": matmul_roofline_flops(2048, 3) / 1e9}
        step_params = {**params, decoder.QUANTIZED: quantized} if quantized else params
        # the weights a step reads: the GGUF blocks where the kernel reads them, else float32
        weights = decode_weight_bytes(step_params, None, cfg) if quantized else floor.weight_bytes(cfg, 4)
        roof = steps["jnp_matmul_roofline_gflops"] * 1e9
        for ctx in contexts:
            entry: dict[str, Any] = {"ours_step_ms": 1e3 * decode_step_s(cfg, step_params, args.step_batch, ctx, n,
                                                                       args.seed, args.repeats)}
            # a step reads every weight once and each row's K/V of its ctx + t earlier tokens, and
            # computes each row's flops_per_token (at the matmul roofline, compute_floor_ms)
            entry["floor_bytes"] = weights + args.step_batch * floor.kv_bytes_per_token(cfg, 4) * (ctx + n / 2)
            entry["compute_floor_ms"] = 1e3 * args.step_batch * cfg.flops_per_token(int(ctx + n / 2)) / roof
            if hf_model is not None:
                hf = HFRunner(hf_model, make_prompts(args.step_batch, ctx, cfg.vocab_size, args.seed, 1.0), n,
                              args.seed)
                hf(new_tokens=2)
                short = min(hf(new_tokens=1) for _ in range(args.repeats))
                full = min(hf(new_tokens=n) for _ in range(args.repeats))
                entry["hf_step_ms"] = 1e3 * max(full - short, 0.0) / (n - 1)
            steps[str(ctx)] = entry
        bandwidth.append(measured_read_bandwidth())
        steps["read_bytes_per_s"] = max(bandwidth)
        for ctx in contexts:
            entry = steps[str(ctx)]
            entry["bandwidth_floor_ms"] = 1e3 * entry["floor_bytes"] / steps["read_bytes_per_s"]
            entry["floor_ms"] = max(entry["bandwidth_floor_ms"], entry["compute_floor_ms"])
            entry["ours_over_floor"] = entry["ours_step_ms"] / entry["floor_ms"]
        if "32" in steps and "800" in steps:
            steps["per_step_ratio_800_over_32"] = steps["800"]["ours_step_ms"] / steps["32"]["ours_step_ms"]
            report["per_step_ratio_800_over_32"] = steps["per_step_ratio_800_over_32"]
        steps["torch_matmul_roofline_gflops"] = (torch_matmul_flops(2048, 3) / 1e9
                                                 if hf_model is not None else None)
        report["per_step"] = steps
    report["loadavg_1min_start_end"] = [load_start, os.getloadavg()[0]]
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
