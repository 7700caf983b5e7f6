"""A model-free chat tokenizer for rollout tests: one token per character (codes capped at 255),
pad 0, stop 1; chat messages rendered as ``<role>content``."""


class CharTokenizer:
    pad_id = 0
    stop_ids = (1,)

    def encode_text(self, text):
        return [min(ord(c), 255) for c in text]

    def encode_chat(self, messages):
        return self.encode_text("".join(f"<{m['role']}>{m['content']}" for m in messages))

    def decode(self, ids):
        return "".join(chr(int(i)) for i in ids if int(i) > 1)
