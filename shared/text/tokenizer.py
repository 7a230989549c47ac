"""One Tokenizer for every model kvmesh serves.

Two backends: a Hugging Face ``tokenizers`` tokenizer read from ``tokenizer.json`` +
``tokenizer_config.json`` (+ ``chat_template.jinja``), and the byte-level tokenizer of
``kvmesh-tiny`` (ids 0..255 are bytes, specials follow). The model's chat template comes with the
tokenizer files; rendering it is ``kvmesh.shared.text.chat_template``'s job.

Turning generated ids back into text, one token at a time, is ``kvmesh.shared.text.detokenize``'s job.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from kvmesh.shared.config.json_object import json_object
from kvmesh.shared.text.chat_template import ChatTemplate, ChatTemplateError
from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
    """Tokenizer files that are missing or malformed, or a request the tokenizer cannot serve."""


class _Backend(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def special_ids(self) -> frozenset[int]: ...


class _HFBackend:
    def __init__(self, path: Path) -> None:
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise TokenizerError(f"{path}: cannot parse tokenizer: {e}") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def special_ids(self) -> frozenset[int]:
        added = self._tok.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary")
        if _BYTE_FALLBACK.fullmatch(piece):  # sentencepiece's byte fallback: <0xE2>
            return bytes([int(piece[3:5], 16)])
        is_byte_level = "ByteLevel" in repr(self._tok.decoder)
        if is_byte_level and all(c in _UNICODE_TO_BYTE for c in piece):  # GPT-2's alphabet
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self._tok.decode([token_id], skip_special_tokens=False).encode()


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (``bytes_to_unicode``), inverted."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_UNICODE_TO_BYTE = _gpt2_byte_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class _ByteBackend:
    """ids 0..255 are raw bytes; ``specials[i]`` is id 256 + i and is matched whole in text."""

    def __init__(self, specials: Sequence[str]) -> None:
        self.specials = list(specials)
        self._special_ids = {s: 256 + i for i, s in enumerate(self.specials)}
        self._split = (
            re.compile("(" + "|".join(re.escape(s) for s in self.specials) + ")")
            if specials
            else None
        )

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.specials)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # Special tokens in the text are always recognised (as HF added tokens are); add_special_tokens
        # only controls the BOS the Tokenizer prepends.
        parts = self._split.split(text) if self._split else [text]
        ids: list[int] = []
        for part in parts:
            special = self._special_ids.get(part)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        out = bytearray()
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif 256 <= i < self.vocab_size:
                if not skip_special_tokens:
                    out.extend(self.specials[i - 256].encode("utf-8"))
            else:
                raise TokenizerError(
                    f"token id {i} is outside the byte-level vocabulary (size {self.vocab_size})"
                )
        return out.decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return self._special_ids.get(token)

    def special_ids(self) -> frozenset[int]:
        return frozenset(range(256, self.vocab_size))

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < 256:
            return bytes([token_id])
        return self.decode([token_id], skip_special_tokens=False).encode()


class Tokenizer:
    """Text <-> token ids, plus the model's chat template."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token: str | None,
        eos_tokens: Sequence[str],
        extra_eos_token_ids: Iterable[int] = (),
        add_bos_token: bool,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        source: str = "<in code>",
    ) -> None:
        self._backend = backend
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.bos_token_id = self._special_id(bos_token)
        eos_ids = {self._special_id(t) for t in eos_tokens} | set(extra_eos_token_ids)
        self.eos_token_ids: set[int] = {i for i in eos_ids if i is not None}
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.add_eos_token = add_eos_token and self.eos_token is not None
        self.chat_template = chat_template  # the template's text (None: the model has none)
        self._special_tokens = dict(special_tokens or {})
        self._template: ChatTemplate | None = None  # compiled on first use

    def _special_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{self.source}: special token {token!r} is not in the vocabulary")
        return token_id

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, extra_eos_token_ids: Iterable[int] = ()
    ) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja from ``directory``."""
        return _load_hf_tokenizer(Path(directory), extra_eos_token_ids)

    @classmethod
    def byte_level(
        cls,
        specials: Sequence[str],
        *,
        bos_token: str,
        eos_tokens: Sequence[str],
        chat_template: str | None,
    ) -> Tokenizer:
        """A byte-level tokenizer: ids 0..255 are bytes, ``specials`` follow from 256."""
        return cls(
            _ByteBackend(specials),
            bos_token=bos_token,
            eos_tokens=eos_tokens,
            add_bos_token=True,
            chat_template=chat_template,
            source="<byte-level tokenizer>",
        )

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens)
        if add_special_tokens:
            # HF tokenizer.json post-processors often add BOS themselves; never add it twice.
            if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
                ids = [self.bos_token_id, *ids]
            if self.add_eos_token:
                eos_id = self._special_id(self.eos_token)
                if not ids or ids[-1] != eos_id:
                    ids = [*ids, eos_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a part of a multi-byte character decodes to U+FFFD
        alone; its bytes do not): OpenAI's logprobs ``bytes``."""
        return self._backend.token_bytes(token_id)

    def special_ids(self) -> frozenset[int]:
        """The special tokens' ids (BOS, EOS, chat markers): no text of the output."""
        return self._backend.special_ids()

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's chat template.
        The result usually starts with the BOS text already: encode it with
        ``add_special_tokens=False`` (or use ``encode_chat``)."""
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.source}: this tokenizer has no chat template (looked for 'chat_template' in "
                "tokenizer_config.json and a chat_template.jinja file); send a plain prompt instead"
            )
        try:
            if self._template is None:
                self._template = ChatTemplate(self.chat_template, self.source)
            context = {
                **self._special_tokens,
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
                **kwargs,
            }
            return self._template.render(messages, add_generation_prompt, **context)
        except ChatTemplateError as e:
            raise TokenizerError(str(e)) from None

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **context: Any,
    ) -> list[int]:
        """Render the chat template (``context``: more of its variables, such as ``tools``) and
        encode it without adding special tokens a second time."""
        text = self.apply_chat_template(messages, add_generation_prompt, **context)
        return self.encode(text, add_special_tokens=False)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    return json_object(path.read_text(encoding="utf-8"), str(path), TokenizerError)


def _load_hf_tokenizer(directory: Path, extra_eos_token_ids: Iterable[int]) -> Tokenizer:
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        hint = (
            " (only a slow tokenizer.model is present; convert it to tokenizer.json with transformers)"
            if (directory / "tokenizer.model").exists()
            else ""
        )
        raise TokenizerError(
            f"{tokenizer_json}: file not found; kvmesh needs a fast tokenizer.json{hint}"
        )
    backend = _HFBackend(tokenizer_json)
    config_path = directory / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    source = str(config_path if config_path.is_file() else tokenizer_json)

    template = config.get("chat_template")
    if isinstance(
        template, list
    ):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    for name in ("chat_template.jinja",):
        if template is None and (directory / name).is_file():
            template = (directory / name).read_text(encoding="utf-8")
            source = str(directory / name)
    if template is None and (directory / "chat_template.json").is_file():
        template = _read_json(directory / "chat_template.json").get("chat_template")

    eos = _token_text(config.get("eos_token"))
    special_tokens = {
        key: text
        for key in ("unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
        if (text := _token_text(config.get(key))) is not None
    }
    return Tokenizer(
        backend,
        bos_token=_token_text(config.get("bos_token")),
        eos_tokens=[eos] if eos is not None else [],
        extra_eos_token_ids=extra_eos_token_ids,
        add_bos_token=bool(config.get("add_bos_token", False)),
        add_eos_token=bool(config.get("add_eos_token", False)),
        chat_template=template,
        special_tokens=special_tokens,
        source=source,
    )
