import json

import pytest
from kvmesh.shared.model.tiny import tiny_tokenizer
from kvmesh.shared.text.tokenizer import Tokenizer, TokenizerError
from support.hf_fixtures import (
    LLAMA_CHAT_TEMPLATE,
    LLAMA_SPECIALS,
    QWEN2_CHAT_TEMPLATE,
    QWEN2_SPECIALS,
    write_tokenizer,
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "héllo 🦊"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "again, 日本語"},
]
TEXT = "Grüße aus Zürich 🦊 日本語 — ok"


@pytest.fixture
def llama_dir(tmp_path):
    path = tmp_path / "llama"
    path.mkdir()
    write_tokenizer(path, LLAMA_SPECIALS, bos="<s>", eos="</s>", chat_template=LLAMA_CHAT_TEMPLATE)
    return path


@pytest.fixture
def qwen_dir(tmp_path):
    path = tmp_path / "qwen2"
    path.mkdir()
    write_tokenizer(
        path, QWEN2_SPECIALS, bos=None, eos="<|im_end|>", chat_template=QWEN2_CHAT_TEMPLATE
    )
    return path


def test_byte_level_round_trips_text_and_recognises_specials():
    tok = tiny_tokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id == 256
    assert ids[1:] == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + TEXT
    assert tok.encode("a<|user|>b", add_special_tokens=False) == [
        97,
        tok.token_to_id("<|user|>"),
        98,
    ]
    assert tok.eos_token_ids == {257, 261}


def test_byte_level_decode_rejects_ids_outside_vocabulary():
    with pytest.raises(TokenizerError, match="token id 999 is outside"):
        tiny_tokenizer().decode([65, 999])


def test_tiny_chat_template_and_encode_chat_add_bos_once():
    tok = tiny_tokenizer()
    text = tok.apply_chat_template(MESSAGES)
    assert text == (
        "<|bos|><|system|>Be brief.<|end|><|user|>héllo 🦊<|end|><|assistant|>hi<|end|>"
        "<|user|>again, 日本語<|end|><|assistant|>"
    )
    ids = tok.encode_chat(MESSAGES)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.encode(text) == ids  # encode() does not prepend a second BOS either
    assert not tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=False).endswith(
        "<|assistant|>"
    )


def test_chat_template_raise_exception_becomes_tokenizer_error():
    with pytest.raises(TokenizerError, match="chat roles are system, user and assistant, got tool"):
        tiny_tokenizer().apply_chat_template([{"role": "tool", "content": "x"}])


def test_hf_tokenizer_matches_transformers(llama_dir, qwen_dir):
    transformers = pytest.importorskip("transformers")
    for directory in (llama_dir, qwen_dir):
        ours = Tokenizer.from_pretrained(directory)
        theirs = transformers.AutoTokenizer.from_pretrained(directory)
        assert ours.encode(TEXT) == theirs(TEXT).input_ids
        assert ours.vocab_size == len(theirs)
        messages = MESSAGES[1:]  # the Llama fixture template has no system role
        assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        expected = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)[
            "input_ids"
        ]
        assert ours.encode_chat(messages) == expected


def test_hf_tokenizer_special_tokens_from_tokenizer_config(llama_dir):
    tok = Tokenizer.from_pretrained(llama_dir, extra_eos_token_ids=[7])
    assert tok.bos_token_id == 256 and tok.bos_token == "<s>"
    assert tok.eos_token_ids == {257, 7}
    ids = tok.encode("hi")
    assert ids == [
        256,
        *tok.encode("hi", add_special_tokens=False),
    ]  # BOS once, from the post-processor
    assert tok.decode(ids) == "hi" and tok.decode(ids, skip_special_tokens=False) == "<s>hi"


def test_chat_template_from_jinja_file_and_list_form(llama_dir):
    config = json.loads((llama_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (llama_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        TokenizerError, match=r"tokenizer_config\.json: this tokenizer has no chat template"
    ):
        Tokenizer.from_pretrained(llama_dir).apply_chat_template(MESSAGES)
    (llama_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    assert (
        Tokenizer.from_pretrained(llama_dir).apply_chat_template(MESSAGES[:2])
        == "[Be brief.][héllo 🦊]"
    )
    config["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    (llama_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(llama_dir).apply_chat_template(MESSAGES) == "D"


def test_missing_tokenizer_json_is_reported(tmp_path):
    with pytest.raises(TokenizerError, match=rf"{tmp_path / 'tokenizer.json'}: file not found"):
        Tokenizer.from_pretrained(tmp_path)


def test_bad_tokenizer_config_json_is_reported(llama_dir):
    (llama_dir / "tokenizer_config.json").write_text("{")
    with pytest.raises(
        TokenizerError, match=rf"{llama_dir / 'tokenizer_config.json'}: invalid JSON"
    ):
        Tokenizer.from_pretrained(llama_dir)


def test_broken_chat_template_is_reported(llama_dir):
    config = json.loads((llama_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}"
    (llama_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        TokenizerError, match=r"tokenizer_config\.json: chat template has a syntax error"
    ):
        Tokenizer.from_pretrained(llama_dir).apply_chat_template(MESSAGES)


def test_chat_template_renders_as_transformers_without_a_tokenizer():
    from kvmesh.shared.text.chat_template import ChatTemplate, ChatTemplateError

    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}{{ tools }}"
    )
    text = template.render([{"role": "user", "content": "é"}], bos_token="<s>")
    assert text == '<s>"é">None'  # tojson keeps non-ASCII; tools is None unless given
    assert template.render([], add_generation_prompt=False, bos_token="", tools=[1]) == "[1]"
    with pytest.raises(ChatTemplateError, match="rejected the messages: no"):
        ChatTemplate("{{ raise_exception('no') }}").render([])
    with pytest.raises(ChatTemplateError, match=r"t\.jinja: chat template has a syntax error"):
        ChatTemplate("{% for %}", source="t.jinja")


def test_token_bytes_add_up_to_the_text_across_split_characters(llama_dir, qwen_dir):
    text = "héllo — wörld ✓"
    for tok in (
        tiny_tokenizer(),
        Tokenizer.from_pretrained(llama_dir),
        Tokenizer.from_pretrained(qwen_dir),
    ):
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [tok.token_bytes(i) for i in ids]
        assert b"".join(pieces) == text.encode()
        assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # a character split apart
