"""Which sampler's trajectories deviate from the model: ours or Hugging Face ``generate``?

Samples ``--samples`` responses to one chat prompt (a MATH-style problem) from each side at the
same settings (``--temperature``, ``--top-k``, EOS on, ``--max-new-tokens``), then recomputes,
for every generated position, the exact sampling distribution with a teacher-forced forward over
the sample's own prefix (our uncached decoder, ``decoder.logits_fn``: no KV cache, no sampler)
and runs the trajectory-level tests of :mod:`marft_jax.bench.trajectory_stats` on each side: the
stop martingale (``z``: observed minus expected stops over sqrt of the variance; ``z << 0``
means the side stops less often than the model) and the randomized-PIT Kolmogorov-Smirnov test
over every token.

Prints ONE JSON object (the last stdout line) with, per side, the finished fraction, the mean
response length, the martingale and the KS result.

Usage::

    python experiments/eos_trajectories.py                       # 192 samples a side, T 0.5, top-k 50
    python experiments/eos_trajectories.py --samples 64 --rows 32 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from marft_jax.bench import trajectory_stats as stats  # noqa: E402
from marft_jax.bench.sampler import hf_model_from_params  # noqa: E402
from marft_jax.models import decoder  # noqa: E402
from marft_jax.models.registry import load_model  # noqa: E402
from marft_jax.sampling import sampler as smp  # noqa: E402

PROBLEM = ("The sum of two numbers is 22. Their difference is 4. What is the greater of the two numbers?")
SYSTEM = "You are a helpful math assistant. Solve the problem step by step and give the final answer."


def ours(model, prompt, args) -> list[list[int]]:
    s = smp.Sampler(model.cfg, pad_id=model.stop_token_ids[0], stop_ids=model.stop_token_ids)
    conf = smp.SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k)
    out = []
    for c in range(args.samples // args.rows):
        g = s(model.params, [prompt] * args.rows, key=jax.random.key(args.seed * 1000 + c), config=conf)
        out += [list(map(int, g.tokens[r, :g.lengths[r]])) for r in range(args.rows)]
    return out


def hf(model, prompt, args) -> list[list[int]]:
    import torch
    from transformers import GenerationConfig

    torch.set_num_threads(os.cpu_count() or 1)
    m = hf_model_from_params(model.cfg, model.params)
    stops = list(model.stop_token_ids)
    gen = GenerationConfig(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=1.0,
                           max_new_tokens=args.max_new_tokens, eos_token_id=stops, pad_token_id=stops[0],
                           repetition_penalty=1.0)
    ids = torch.tensor([prompt] * args.rows)
    out = []
    for c in range(args.samples // args.rows):
        torch.manual_seed(args.seed * 1000 + c)
        with torch.no_grad():
            new = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)[:, len(prompt):]
        for row in new.numpy().tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            out.append(row[:end])
    return out


def exact_probs(model, prompt, responses, args) -> list[np.ndarray]:
    """Per response ``[len, V]``: the sampling distribution at each generated position, from a
    teacher-forced forward over prompt + response (right-padded batches)."""
    fn = jax.jit(lambda p, t, v: decoder.logits_fn(p, t, v, model.cfg))
    total = len(prompt) + args.max_new_tokens
    out = []
    for i in range(0, len(responses), args.rows):
        chunk = responses[i:i + args.rows]
        toks = np.zeros((len(chunk), total), np.int32)
        valid = np.zeros((len(chunk), total), bool)
        for r, resp in enumerate(chunk):
            seq = prompt + resp
            toks[r, :len(seq)], valid[r, :len(seq)] = seq, True
        logits = np.asarray(fn(model.params, jnp.asarray(toks), jnp.asarray(valid)))
        for r, resp in enumerate(chunk):
            at = logits[r, len(prompt) - 1:len(prompt) - 1 + len(resp)]        # predicts each response token
            out.append(stats.step_distribution(at, args.temperature, args.top_k))
    return out


def report(name, model, prompt, responses, args) -> dict:
    probs = exact_probs(model, prompt, responses, args)
    stops = set(model.stop_token_ids)
    finished = [bool(r) and r[-1] in stops for r in responses]
    mart = stats.stop_martingale(probs, responses, model.stop_token_ids)
    u = stats.randomized_pit(probs, responses, np.random.default_rng(args.seed))
    ks, lag = stats.ks_uniform(np.concatenate(u)), stats.lag1_correlation(u)
    res = {"finished_fraction": float(np.mean(finished)), "mean_length": float(np.mean([len(r) for r in responses])),
           "distinct_responses": len({tuple(r) for r in responses}), "stop_martingale": mart, "pit_ks": ks,
           "pit_lag1": lag}
    print(f"{name}: finished {res['finished_fraction']:.3f}, mean length {res['mean_length']:.1f}, "
          f"stop z {mart['z']:+.2f} (observed {mart['observed']:.0f}, expected {mart['expected']:.1f}), "
          f"PIT KS d {ks['d']:.4f} p {ks['p_value']:.3g} over {ks['n']} tokens, lag-1 r {lag['r']:+.4f} "
          f"(z {lag['z']:+.2f})", flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--samples", type=int, default=192)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.5)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sides", default="ours,hf")
    args = p.parse_args()
    if args.samples % args.rows:
        raise SystemExit("--samples must be a multiple of --rows")
    model = load_model(args.model, dtype=jnp.float32)
    prompt = list(model.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROBLEM}], add_generation_prompt=True))
    if not isinstance(prompt[0], int):
        prompt = list(model.tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROBLEM}],
            add_generation_prompt=True, return_dict=True)["input_ids"])
    res = {"bench": "eos_trajectories", "model": args.model, "prompt_tokens": len(prompt), "samples": args.samples,
           "temperature": args.temperature, "top_k": args.top_k, "max_new_tokens": args.max_new_tokens,
           "stop_ids": list(model.stop_token_ids)}
    for side in args.sides.split(","):
        t0 = time.perf_counter()
        responses = {"ours": ours, "hf": hf}[side](model, prompt, args)
        res[side] = report(side, model, prompt, responses, args)
        res[side]["sample_s"] = time.perf_counter() - t0
    print(json.dumps(res))


if __name__ == "__main__":
    main()
