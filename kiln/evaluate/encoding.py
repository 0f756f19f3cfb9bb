"""Text to token ids as lm-evaluation-harness 0.4 tokenizes a request for a causal model (HFLM with its defaults:
add_bos_token and prefix_token_id unset), so that kiln scores the rows the harness scores.

    enc = HarnessEncoding(tokenizer, prefix_id)
    enc(text)                       HFLM.tok_encode(text)
    enc(text, special=False)        HFLM.tok_encode(text, add_special_tokens=False): an empty context's continuation
    enc.prefix_id                   HFLM.prefix_token_id: an empty context, and the first rolling window's input

HFLM.tok_encode calls transformers' tokenizer.encode(text) with the tokenizer's defaults: the special tokens
written in the text are their ids, and the tokenizer's post-processor adds its own tokens — a Llama or Gemma
tokenizer's BOS before every context and every whole row, a GPT-2 or Qwen one nothing. Only a text that already
starts with the prefix token's text is encoded without them. The prefix token is the tokenizer's bos_token, else its
eos_token (tokenizer_config.json; kiln.run.source reads it for hf:DIR; `kiln export` names kiln's end-of-text id
as both, so a run's prefix is its end-of-text id). kiln's byte tokenizer has no special tokens and no
post-processor: its encode is all there is (the harness cannot load it anyway).
"""
from __future__ import annotations


class HarnessEncoding:
    def __init__(self, tokenizer, prefix_id: int | None = None):
        self.tokenizer = tokenizer
        self.prefix_id = tokenizer.eot_id if prefix_id is None else prefix_id
        self._hf = getattr(tokenizer, "encode_as_transformers", None)  # BPE, kiln's own or a Hugging Face one
        self._prefix_text = tokenizer.decode([self.prefix_id]) if self._hf is not None else None

    def __call__(self, text: str, special: bool | None = None) -> list[int]:
        """special: None as HFLM decides (the post-processor's tokens unless text starts with the prefix token's
        text), False without them."""
        if self._hf is None:
            return self.tokenizer.encode(text)
        if special is None:
            special = not (self._prefix_text and text.startswith(self._prefix_text))
        return self._hf(text, add_special_tokens=special)
