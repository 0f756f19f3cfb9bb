"""kiln.data.chat against transformers' apply_chat_template: the same text and the same token ids, for templates
that use what Hub templates use (special tokens, raise_exception, whitespace control, trim/lstrip blocks,
tojson, namespace, loop controls, {% generation %}), from a tokenizer saved in a directory as transformers saves
it. Nothing is downloaded: the tokenizer is trained here."""
import json

import pytest

from kiln.data.chat import TemplateError, chat_template, check_messages, render, special_tokens
from kiln.data.tokenizer import BPETokenizer

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")

CHATML = """{%- for message in messages %}
{%- if loop.first and message['role'] != 'system' %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

LLAMA2 = """{% if messages[0]['role'] == 'system' %}
    {% set offset = 1 %}
{% else %}
    {% set offset = 0 %}
{% endif %}
{% for message in messages[offset:] %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ bos_token + '[INST] ' + message['content'].strip() + ' [/INST]' }}
    {% else %}
        {{ ' ' + message['content'].strip() + ' ' + eos_token }}
    {% endif %}
{% endfor %}
"""

TOOLS = """{% set ns = namespace(n=0) %}
{% for message in messages %}
{% if message.role == 'stop' %}{% break %}{% endif %}
{% if message.role == 'skip' %}{% continue %}{% endif %}
{% set ns.n = ns.n + 1 %}
<{{ message.role }}>{{ message | tojson }}
{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}{% endif %}
{% if message.reasoning_content is defined %}[think]{{ message.reasoning_content }}[/think]{% endif %}
{% endfor %}
count={{ ns.n }}{% if add_generation_prompt %}<assistant>{% endif %}{% if enable_thinking is defined %}!{% endif %}"""

CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  2+2? "},
     {"role": "assistant", "content": "4 "}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "café <b>&</b> \u00e9t\u00e9 \U0001f600", "tool_calls": None},
     {"role": "assistant", "content": "ok", "reasoning": "thinking it over"},
     {"role": "skip", "content": "x"}, {"role": "user", "content": "more"}, {"role": "stop", "content": ""},
     {"role": "user", "content": "never"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
    tok.train_from_iterator([json.dumps(CHATS) * 20, CHATML, LLAMA2], trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    directories = {}
    for name, template in (("chatml", CHATML), ("llama2", LLAMA2), ("tools", TOOLS)):
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                    pad_token="<|endoftext|>")
        fast.chat_template = template
        directories[name] = tmp_path_factory.mktemp(name)
        fast.save_pretrained(directories[name])
    return directories


@pytest.mark.parametrize("name", ["chatml", "llama2", "tools"])
def test_render_and_encode_equal_transformers(name, hf_tokenizer_dir):
    directory = hf_tokenizer_dir[name]
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    template, tokens = chat_template(directory), special_tokens(directory)
    assert template is not None and tokens["bos_token"] == "<s>" and tokens["eos_token"] == "</s>"
    ours_tok = BPETokenizer.from_hf(directory)
    for chat in CHATS:
        for gen in (True, False):
            try:
                want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            except Exception as e:  # the template refuses the chat (raise_exception): so must kiln
                with pytest.raises(TemplateError, match="roles must alternate"):
                    render(chat, template, tokens, add_generation_prompt=gen)
                assert "roles must alternate" in str(e)
                continue
            text = render(chat, template, tokens, add_generation_prompt=gen)
            assert text == want
            ids = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=True)
            assert ours_tok.encode_chat(text) == ids["input_ids"]
    # template variables reach the template as apply_chat_template's keyword arguments do
    kw = dict(tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert render(CHATS[0], template, tokens, enable_thinking=True) == theirs.apply_chat_template(CHATS[0], **kw)


def test_special_tokens_in_text_are_ids_only_for_chat():
    tok = BPETokenizer.train(["<|im_start|> hello world " * 50], 300)
    assert tok.encode_chat("<|endoftext|>x") == [tok.eot_id] + tok.encode("x")
    assert tok.eot_id not in tok.encode("<|endoftext|>x")  # ordinary text never injects the id


def test_templates_from_the_config_file_and_bad_input(tmp_path):
    assert chat_template(tmp_path) is None and special_tokens(tmp_path) == {}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "default", "template": "{{ messages[0].content }}"},
                          {"name": "tool_use", "template": "T"}],
        "bos_token": {"content": "<s>", "__type": "AddedToken"}}))
    assert chat_template(tmp_path) == "{{ messages[0].content }}" and chat_template(tmp_path, "tool_use") == "T"
    assert special_tokens(tmp_path) == {"bos_token": "<s>"}
    with pytest.raises(TemplateError, match="does not parse"):
        render(CHATS[0], "{% for m in messages %}")
    with pytest.raises(ValueError, match="x.jsonl:3: message 1 must be an object"):
        check_messages([{"role": "user", "content": "a"}, "b"], "x.jsonl:3")
    with pytest.raises(ValueError, match="non-empty list"):
        check_messages([], "x.jsonl:1")
