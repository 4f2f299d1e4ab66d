"""Kimi-K2.5's chat format in miniature: its special tokens, its template, a BPE tokenizer.

The template follows Kimi-K2.5's: role headers ``<|im_user|>user<|im_middle|>``, turns closed
by ``<|im_end|>``, a default system turn, and reasoning inside ``<think>...</think>``. An
assistant turn after the last user turn carries its reasoning; earlier assistant turns carry an
empty ``<think></think>`` (the template drops history reasoning). The generation prompt ends with
``<think>`` unless ``chat_template_kwargs`` sets ``thinking: false`` (then ``<think></think>``):
vLLM's ``kimi_k2`` reasoning parser assumes exactly this.

Invariants: the same texts and vocabulary size give the same tokenizer; every special token is
one token; ``<think>``/``</think>`` are in the vocabulary, which the reasoning parser looks up.
"""

from __future__ import annotations

BOS, EOS, PAD = "[BOS]", "[EOS]", "[PAD]"
TURN_END = "<|im_end|>"  # the end of every turn: what generation stops at
ROLE_TOKENS = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
THINK_TOKENS = ["<think>", "</think>"]
# Kimi-K2.5's media and tool-call tokens: never produced here, present so that the vocabulary
# (and vLLM's Kimi-K2.5 media-token lookup) has the hero's shape.
MEDIA_TOKENS = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]
TOOL_TOKENS = [
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
SPECIAL_TOKENS = [
    BOS,
    EOS,
    PAD,
    TURN_END,
    *ROLE_TOKENS,
    *THINK_TOKENS,
    *MEDIA_TOKENS,
    *TOOL_TOKENS,
]
MEDIA_PLACEHOLDER = "<|media_pad|>"
DEFAULT_SYSTEM = "You are a helpful assistant."

CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM + "<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ m['role'] }}<|im_middle|>{%- endif -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- if loop.index0 > ns.last_user and m.get('reasoning_content') -%}"
    "<think>{{ m['reasoning_content'] }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
    "{{ m['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>"
    "{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int):
    """A byte-level BPE tokenizer over ``texts`` with Kimi's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS, EOS, PAD)],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
