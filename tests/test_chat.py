"""The chat tokenizer renders hybrid-reasoning templates (Qwen3) with thinking off, and leaves
templates that do not know the switch unchanged."""

import jinja2

from marft_jax.envs.chat import HFChatTokenizer

QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
              "{% endif %}")
PLAIN = QWEN3_LIKE.split("{% if enable_thinking")[0] + "{% endif %}"


class TemplateTokenizer:
    """The slice of a ``transformers`` tokenizer that :class:`HFChatTokenizer` uses: a jinja chat
    template rendered with the caller's variables, one id per character."""

    eos_token = None
    pad_token_id = 0
    unk_token_id = None

    def __init__(self, template: str):
        self.template = jinja2.Template(template)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **variables):
        assert not tokenize
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(map(chr, ids))


def _render(template: str) -> str:
    tok = HFChatTokenizer(TemplateTokenizer(template), stop_ids=[1])
    return "".join(map(chr, tok.encode_chat([{"role": "user", "content": "2 + 2?"}])))


def test_hybrid_reasoning_templates_render_with_thinking_off():
    assert _render(QWEN3_LIKE).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_templates_without_the_switch_are_unchanged():
    assert _render(PLAIN) == "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"
