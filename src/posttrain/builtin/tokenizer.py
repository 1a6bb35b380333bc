"""The built-in byte-level tokenizer: one token per UTF-8 byte plus ``<pad>``, ``<s>`` and
``</s>``. It covers any text, so a user can bring small tasks of their own to the built-in
model, and it is saved as a plain ``tokenizer.json`` that ``AutoTokenizer`` loads.

(A Llama model type keeps this saved tokenizer under transformers 5; some other model types
make transformers substitute a tokenizer class of its own, which then drops spaces.)
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins ByteLevel uses for bytes, in byte order (GPT-2's map)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh byte-level tokenizer: ids 0-2 special, id ``3 + b`` for byte ``b``."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in _byte_alphabet():
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast
