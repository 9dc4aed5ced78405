"""Chat templates against transformers' own `apply_chat_template` (the renderer every tokenizer_config.json
template is written for)."""

import json

import pytest

from dsv41.chat import DEFAULT_TEMPLATE, ChatTemplate

# A ChatML-style template with the constructs real ones use: a system-prompt default, loop variables,
# whitespace control, raise_exception, bos/eos and the generation prompt.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for message in messages %}\n"
    "  {% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}\n"
    "  <|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "  {% if message['role'] == 'assistant' and not loop.last %}{{ eos_token }}{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the pass key?"}],
    [{"role": "system", "content": "Answer with digits."}, {"role": "user", "content": "  Key?  "},
     {"role": "assistant", "content": "12345"}, {"role": "user", "content": "Again, please."}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=TEMPLATE)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_a_tokenizer_config_template_renders_as_transformers_does(tmp_path, hf_tokenizer, messages, generation_prompt):
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    ours = ChatTemplate.from_tokenizer_config(path).render(messages, add_generation_prompt=generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours == theirs


def test_named_templates_bad_roles_and_missing_templates(tmp_path):
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                                  {"name": "default", "template": TEMPLATE}]}))
    template = ChatTemplate.from_tokenizer_config(path)
    with pytest.raises(ValueError, match="messages: the chat template refused them: Unknown role: wizard"):
        template.render([{"role": "wizard", "content": "hi"}])
    path.write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match="expected a 'chat_template' string"):
        ChatTemplate.from_tokenizer_config(path)
    with pytest.raises(ValueError, match="does not parse as a Jinja template"):
        ChatTemplate("{% for m in messages %}")


def test_the_default_template_is_the_contents_as_they_are():
    """The byte-level passkey model has no chat format: a user message holding a passkey prompt is that prompt."""
    messages = [{"role": "system", "content": "A "}, {"role": "user", "content": "The pass key is 1. What is it? "}]
    assert ChatTemplate(DEFAULT_TEMPLATE).render(messages) == "A The pass key is 1. What is it? "
