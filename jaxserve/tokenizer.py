"""Tokenizers: one interface over HF ``tokenizer.json``, sentencepiece ``.model`` files and the vocabulary inside
GGUF files; chat templates rendered with jinja2 the way HF renders them; streaming (incremental) detokenization.

Every source is turned into a ``tokenizers.Tokenizer`` (the Rust library HF uses), so encoding, special-token
splitting and decoding behave the same whichever file the vocabulary came from:

* ``tokenizer.json`` is loaded as is (its post-processor decides BOS/EOS, as in transformers 5);
  ``tokenizer_config.json`` next to it adds the chat template and the named special tokens.
* a sentencepiece ``.model`` is read with the ``sentencepiece`` package (its ModelProto) and rebuilt: unigram or
  BPE model, byte fallback, its normalizer, the dummy-prefix space.
* a GGUF file's ``tokenizer.ggml.*`` metadata is rebuilt as llama.cpp reads it: ``gpt2`` is byte-level BPE with
  the merges from the file and the pre-tokenizer regexes named by ``tokenizer.ggml.pre``; ``llama`` is
  sentencepiece BPE, whose merges follow from the token scores (the highest-scoring pair merges first).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

logger = logging.getLogger(__name__)

# Token types, numbered alike in sentencepiece's ModelProto and in GGUF's tokenizer.ggml.token_type.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"  # sentencepiece's visible space
_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character
# Texts (characters) and id lists longer than this go through the backend's batch calls, which let go of the GIL
# while they work: its single-text calls hold it throughout (3 s for a 4 MB text), so no other thread, the
# server's event loop included, runs meanwhile.
_RELEASE_GIL_FROM = 16 * 1024


def check_unicode(text: str) -> None:
    """Raises ValueError if ``text`` has no UTF-8 encoding (a lone surrogate), naming the character and where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"the text is not valid Unicode: {e.reason} (a lone surrogate {text[e.start]!r} at character {e.start})"
        ) from None


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template.

    Attributes:
        vocab_size: number of token ids, added tokens included.
        bos_token_id: the beginning-of-sequence id, or None.
        eos_token_ids: every id that ends generation (EOS, end-of-turn, ...), the main EOS first.
        chat_template: the default jinja2 chat template, or None.
        chat_templates: named alternatives (e.g. ``"tool_use"``) besides the default.
        source: the path the tokenizer was loaded from, for messages.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        chat_template: str | None = None,
        chat_templates: dict[str, str] | None = None,
        vocab_size: int | None = None,
        source: str = "",
    ):
        """Wraps a ``tokenizers.Tokenizer``.

        Args:
            backend: the tokenizer proper; special tokens must already be added to it.
            bos_token, eos_tokens, unk_token, pad_token: the named special tokens, as strings in the vocabulary
                (the chat template sees them as ``bos_token``, ``eos_token``, ...).
            add_bos, add_eos: whether ``encode`` adds BOS/EOS; None keeps the backend's own post-processor.
            chat_template, chat_templates: the default template and named others.
            vocab_size: number of ids when the backend's count is off (a vocabulary with duplicate strings).
            source: where this came from, for messages.
        """
        self._backend = backend
        self.source = source
        self.chat_template = chat_template
        self.chat_templates = dict(chat_templates or {})
        self.vocab_size = max(vocab_size or 0, backend.get_vocab_size(with_added_tokens=True))
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.bos_token_id = self._known_id(bos_token)
        eos_ids = [self._known_id(t) for t in eos_tokens]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos_ids if i is not None))
        if add_bos is not None or add_eos is not None:
            self._set_post_processor(bool(add_bos), bool(add_eos))

    def _known_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos = self.bos_token if add_bos and self.bos_token_id is not None else None
        eos = self.eos_token if add_eos and self.eos_token_ids else None
        if bos is None and eos is None:
            self._backend.post_processor = None
            return
        ends = list(dict.fromkeys((t, self._backend.token_to_id(t)) for t in (bos, eos) if t is not None))

        def segment(seq: str, type_id: int) -> str:
            head = f"{bos}:{type_id} " if bos else ""
            tail = f" {eos}:{type_id}" if eos else ""
            return f"{head}${seq}:{type_id}{tail}"

        self._backend.post_processor = processors.TemplateProcessing(
            single=segment("A", 0), pair=f"{segment('A', 0)} {segment('B', 1)}", special_tokens=ends
        )

    # -- ids and text -------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) become their ids.

        Args:
            text: the text.
            add_special_tokens: add BOS/EOS as this tokenizer's config says (SmolLM2's GGUF adds none).

        Raises:
            ValueError: ``text`` is not valid Unicode (a lone surrogate, such as JSON's "\\ud800"), naming it.
        """
        try:
            if len(text) < _RELEASE_GIL_FROM:
                return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
            batch = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)  # fast: no offsets
            return batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:  # the tokenizers library's word for a str that is no UTF-8: checked only then
            check_unicode(text)
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are left out unless ``skip_special_tokens`` is False."""
        ids = [int(i) for i in ids]
        if len(ids) < _RELEASE_GIL_FROM:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def to_json(self) -> str:
        """The tokenizer as HF ``tokenizer.json`` text (what grammar engines load)."""
        return self._backend.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """Whether ``decode(..., skip_special_tokens=True)`` leaves this id out."""
        return int(token_id) in self._special_ids

    @property
    def added_tokens(self) -> dict[int, tokenizers.AddedToken]:
        """The tokens added to the vocabulary (special or not), by id, as HF's ``added_tokens_decoder``."""
        return dict(self._backend.get_added_tokens_decoder())

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens, as a chat template sees them."""
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        named |= {"unk_token": self.unk_token, "pad_token": self.pad_token}
        return {k: v for k, v in named.items() if v is not None}

    # -- chat -----------------------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Renders a conversation with the model's chat template, as HF's ``apply_chat_template`` does.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``; keys whose value is None are dropped (OpenAI
                clients send ``content=None`` next to tool calls).
            add_generation_prompt: end with the header that starts the assistant's turn.
            tokenize: return token ids (encoded without adding BOS/EOS: the template writes its own) instead of text.
            tools, documents: passed to the template as ``tools`` and ``documents``.
            chat_template: a template to use instead of the model's, or the name of one of ``chat_templates``.
            **kwargs: more template variables (they override the special tokens of the same name).

        Raises:
            ValueError: the model has no chat template and none was given.
            jinja2.TemplateError: the template failed (e.g. its ``raise_exception`` for a bad role order).
        """
        source = self._pick_template(chat_template, tools)
        conversation = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        context = {**self.special_tokens, **kwargs}
        text = _compile_template(source).render(
            messages=conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **context,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def chat_template_source(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The template text ``apply_chat_template`` would render with these arguments (ValueError if none)."""
        return self._pick_template(chat_template, tools)

    def _pick_template(self, chat_template: str | None, tools: list[dict] | None) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is None:
            where = self.source or "this model"
            raise ValueError(f"the tokenizer of {where} has no chat template; pass chat_template= to give one")
        return self.chat_template

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"


class IncrementalDetokenizer:
    """Turns generated token ids, fed one at a time, into text deltas for streaming.

    Each ``add`` decodes only a short window: the tokens since the last emitted boundary plus the ones before it,
    and emits the part past what those earlier tokens decode to. Decoders that strip a leading space (sentencepiece)
    strip it from both, so it cancels. A delta that ends in U+FFFD is held back: the bytes of a multi-byte
    character are still arriving through byte-level or byte-fallback tokens.

    The deltas joined equal ``tokenizer.decode(generated ids)`` once ``flush`` has been called, except that a
    character whose last bytes never came (generation stopped inside it) is left out rather than written as U+FFFD,
    as vLLM's detokenizer does. ``prompt_ids`` is kept for callers, but the text covers the
    generated tokens alone, like ``decode`` of them, so streamed and non-streamed outputs agree.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.prompt_ids = tuple(int(i) for i in prompt_ids)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []  # every generated id
        self.text = ""  # every delta so far, joined
        self._window: list[int] = []  # the ids the decoder sees (special ids left out when skipping them)
        self._prefix = 0  # start of the decode window in _window
        self._read = 0  # _window[:_read] is already in self.text

    def add(self, token_id: int) -> str:
        """Feeds one generated id; returns the new text (possibly empty)."""
        token_id = int(token_id)
        self.token_ids.append(token_id)
        if self.skip_special_tokens and self.tokenizer.is_special(token_id):
            return ""  # decode() filters these out before decoding, so leaving them out here changes nothing
        self._window.append(token_id)
        return self._advance(hold_partial=True)

    def flush(self) -> str:
        """Returns the text held back at the end, less a trailing character whose remaining bytes never came."""
        return self._advance(hold_partial=False)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, hold_partial: bool) -> str:
        if self._read == len(self._window):
            return ""
        prefix_text = self._decode(self._window[self._prefix : self._read])
        full = self._decode(self._window[self._prefix :])
        if full.endswith(_REPLACEMENT):
            if hold_partial:
                return ""
            full = full.rstrip(_REPLACEMENT)  # the end: the cut character's bytes will never be completed
        if full.startswith(prefix_text):
            delta = full[len(prefix_text) :]
        else:  # a decoder that rewrote earlier text: decode everything once; emitted text cannot be taken back
            whole = self._decode(self._window).rstrip(_REPLACEMENT)  # (it ends as full does)
            delta = whole[len(self.text) :] if whole.startswith(self.text) else ""
        self._prefix, self._read = self._read, len(self._window)
        self.text += delta
        return delta


# -- loading --------------------------------------------------------------------------------------------------------


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Loads the tokenizer at ``path``.

    Args:
        path: a ``.gguf`` file; a directory with ``tokenizer.json`` (HF) or ``tokenizer.model`` (sentencepiece),
            or holding exactly one ``.gguf`` file; a ``tokenizer.json``; or a sentencepiece ``.model`` file. A
            ``tokenizer_config.json`` (and ``generation_config.json``) next to it adds special tokens, BOS/EOS
            behaviour and the chat template.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: nothing usable is there, or the GGUF file's tokenizer is of an unsupported kind.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path}: the path does not exist")
    if path.is_file():
        if path.suffix == ".gguf":
            return _from_gguf(path)
        if path.suffix == ".model":
            return _from_sentencepiece(path)
        if path.name == "tokenizer.json" or path.suffix == ".json":
            return _from_tokenizer_json(path)
        raise ValueError(f"no tokenizer at {path}: expected a .gguf file, a sentencepiece .model, or tokenizer.json")
    if (path / "tokenizer.json").is_file():
        return _from_tokenizer_json(path / "tokenizer.json")
    if (path / "tokenizer.model").is_file():
        return _from_sentencepiece(path / "tokenizer.model")
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _from_gguf(ggufs[0])
    found = f" ({len(ggufs)} .gguf files: name one)" if ggufs else ""
    expected = "expected tokenizer.json, tokenizer.model or a .gguf file"
    raise ValueError(f"no tokenizer in directory {path}: {expected}{found}")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _config_templates(directory: Path, config: dict) -> tuple[str | None, dict[str, str]]:
    """The default and named chat templates from a HF directory (chat_template.jinja wins, as in HF)."""
    template = config.get("chat_template")
    if template is None:
        template = _read_json(directory / "chat_template.json").get("chat_template")
    named = {}
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.pop("default", None)
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return template, named


def _eos_tokens(backend: tokenizers.Tokenizer, directory: Path, config: dict) -> list[str]:
    """EOS from tokenizer_config.json, then every other id generation_config.json stops at."""
    eos = [_content(config.get("eos_token"))]
    ids = _read_json(directory / "generation_config.json").get("eos_token_id")
    for token_id in ids if isinstance(ids, list) else [ids]:
        if isinstance(token_id, int):
            eos.append(backend.id_to_token(token_id))
    return [t for t in eos if t is not None]


def _from_tokenizer_json(path: Path) -> Tokenizer:
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on files it cannot read
        raise ValueError(f"{path} is not a readable tokenizer.json ({e})") from e
    config = _read_json(path.parent / "tokenizer_config.json")
    config = {**_read_json(path.parent / "special_tokens_map.json"), **config}
    template, named = _config_templates(path.parent, config)
    # BOS/EOS come from tokenizer.json's post-processor alone; the config's add_bos_token/add_eos_token are ignored
    # next to a tokenizer.json, as transformers 5 ignores them
    return Tokenizer(
        backend,
        bos_token=_content(config.get("bos_token")),
        eos_tokens=_eos_tokens(backend, path.parent, config),
        unk_token=_content(config.get("unk_token")),
        pad_token=_content(config.get("pad_token")),
        chat_template=template,
        chat_templates=named,
        source=str(path.parent),
    )


def _from_sentencepiece(path: Path) -> Tokenizer:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:  # protobuf's DecodeError and friends
        raise ValueError(f"{path} is not a sentencepiece model ({type(e).__name__}: {e})") from e
    if not proto.pieces:
        raise ValueError(f"{path} is not a sentencepiece model (no pieces)")
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    if spec.model_type not in (spec.UNIGRAM, spec.BPE):
        raise ValueError(f"{path}: sentencepiece model type {spec.model_type} is not supported (only unigram and BPE)")
    pieces = [p.piece for p in proto.pieces]
    backend = _sentencepiece_backend(
        pieces,
        [p.score for p in proto.pieces],
        [p.type for p in proto.pieces],
        unigram=spec.model_type == spec.UNIGRAM,
        add_dummy_prefix=norm.add_dummy_prefix,
        normalizer=_sentencepiece_normalizer(norm),
    )
    config = _read_json(path.parent / "tokenizer_config.json")
    config = {**_read_json(path.parent / "special_tokens_map.json"), **config}
    _add_config_tokens(backend, config, path)

    def named(key: str, default_id: int) -> str | None:
        if key in config:
            return _content(config[key])
        return pieces[default_id] if 0 <= default_id < len(pieces) else None

    template, named_templates = _config_templates(path.parent, config)
    return Tokenizer(
        backend,
        bos_token=named("bos_token", spec.bos_id),
        eos_tokens=[t for t in (named("eos_token", spec.eos_id), *_eos_tokens(backend, path.parent, {})) if t],
        unk_token=named("unk_token", spec.unk_id),
        pad_token=named("pad_token", spec.pad_id),
        add_bos=config.get("add_bos_token", True),  # sentencepiece LLMs (Llama, Mistral) start with BOS
        add_eos=config.get("add_eos_token", False),
        chat_template=template,
        chat_templates=named_templates,
        source=str(path),
    )


def _add_config_tokens(backend: tokenizers.Tokenizer, config: dict, path: Path) -> None:
    """Adds the tokens of tokenizer_config.json's added_tokens_decoder that the .model lacks, at their ids."""
    added = sorted((int(i), t) for i, t in config.get("added_tokens_decoder", {}).items())
    for token_id, token in added:
        content, special = token["content"], bool(token.get("special", False))
        existing = backend.token_to_id(content)
        if existing == token_id and (not special or token_id in backend.get_added_tokens_decoder()):
            continue
        flags = {k: bool(token.get(k, False)) for k in ("lstrip", "rstrip", "single_word")}
        new = AddedToken(content, normalized=bool(token.get("normalized", not special)), special=special, **flags)
        (backend.add_special_tokens if special else backend.add_tokens)([new])
        got = backend.token_to_id(content)
        if got != token_id:
            raise ValueError(f"{path}: added token {content!r} should have id {token_id}, but got {got}")


def _sentencepiece_normalizer(spec) -> normalizers.Normalizer | None:
    """sentencepiece's normalizer: its compiled character map, then the removal of extra spaces."""
    steps = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:  # leading and trailing spaces dropped, runs of spaces made one
        steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    return normalizers.Sequence(steps) if steps else None


def _sentencepiece_backend(
    pieces: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    unigram: bool,
    add_dummy_prefix: bool,
    normalizer: normalizers.Normalizer | None = None,
) -> tokenizers.Tokenizer:
    """A sentencepiece vocabulary as a ``tokenizers.Tokenizer``.

    Unigram keeps its scores as log-probabilities (Viterbi). BPE has no merges written down: sentencepiece merges
    the adjacent pair whose joined piece scores highest, so the merge list is every split of every piece into two
    pieces, ranked by the joined piece's score.
    """
    unk_id = next((i for i, t in enumerate(types) if t == UNKNOWN), None)
    byte_fallback = BYTE in types
    if unigram:
        vocab = [(piece, float(score)) for piece, score in zip(pieces, scores)]
        model = models.Unigram(vocab, unk_id=unk_id, byte_fallback=byte_fallback)
    else:
        vocab = {piece: i for i, piece in enumerate(pieces)}
        unk = pieces[unk_id] if unk_id is not None else None
        merges = _merges_from_scores(pieces, scores, types)
        model = models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback)
    backend = tokenizers.Tokenizer(model)
    # sentencepiece writes spaces as U+2581 and puts one before the text, even before a text that starts with a
    # space. Done as normalization it also comes after each added token (text is normalized piece by piece between
    # them), which is what llama.cpp does; sentencepiece, which knows no control tokens in text, puts none after
    # its user-defined pieces.
    steps = [normalizer] if normalizer is not None else []
    steps += [normalizers.Prepend(_SPACE)] if add_dummy_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    decoding = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_dummy_prefix:
        decoding.append(decoders.Strip(" ", 1, 0))  # the dummy prefix's space, before the first word
    backend.decoder = decoders.Sequence(decoding)
    _add_typed_tokens(backend, pieces, types)
    return backend


def _merges_from_scores(pieces: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    normal = {p: i for i, p in enumerate(pieces) if types[i] in (NORMAL, USER_DEFINED)}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, normal[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_typed_tokens(backend: tokenizers.Tokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Control and unknown tokens become special added tokens (matched whole in the raw text, skipped when decoding);
    user-defined ones become plain added tokens (matched whole, decoded as text), as llama.cpp treats them."""
    special = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    plain = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


# -- GGUF ----------------------------------------------------------------------------------------------------------

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_FALCON_PUNCT = r"[\p{P}\$\+<=>\^~\|`]+"

# tokenizer.ggml.pre -> the regexes llama.cpp splits text with, applied in turn (each splits the pieces of the last).
_GGUF_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion"), (_GPT2_SPLIT,)),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), (r"\p{N}", _GPT2_SPLIT)
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx", "smaug-bpe"),
        (_LLAMA3_SPLIT,),
    ),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez", "hunyuan"), (_QWEN2_SPLIT,)),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2", "kanana2"), (_GPT4O_SPLIT,)),
    "tekken": (_TEKKEN_SPLIT,),
    "falcon": (_FALCON_PUNCT, _GPT2_SPLIT, r"[0-9][0-9][0-9]"),
}
# Pre-tokenizers whose reference tokenizer.json looks a whole word up in the vocabulary before merging.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves, the others
    (controls, space, ...) are shifted past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    shifted = (b for b in range(256) if b not in table)
    table |= {b: chr(256 + n) for n, b in enumerate(shifted)}
    return dict(sorted(table.items()))


def _byte_level_backend(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str], pre: str | None):
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind == NORMAL and not set(token) <= letters:  # written as text, not in the byte alphabet: respell it
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab[token] = i
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    splits = _GGUF_PRE_SPLITS.get(pre or "default")
    if splits is None:
        logger.warning("GGUF pre-tokenizer %r is not known here; splitting text as GPT-2 does", pre)
        splits = (_GPT2_SPLIT,)
    model = models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES)
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    _add_typed_tokens(backend, tokens, types)
    return backend


def _from_gguf(path: Path) -> Tokenizer:
    from jaxserve.loading.gguf import GGUFCheckpoint

    with GGUFCheckpoint(path) as ckpt:  # our header parser: gguf.GGUFReader takes ~2 s over a 49k vocabulary
        meta = ckpt.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise ValueError(f"{path}: the GGUF file carries no tokenizer (no tokenizer.ggml.model / tokens)")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        merges = meta.get("tokenizer.ggml.merges")
        if merges is None:
            raise ValueError(f"{path}: a 'gpt2' GGUF tokenizer needs tokenizer.ggml.merges")
        backend = _byte_level_backend(tokens, types, merges, meta.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
        add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        backend = _sentencepiece_backend(tokens, scores, types, unigram=False, add_dummy_prefix=add_prefix)
    else:
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")

    def named(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None

    templates = {
        k.removeprefix("tokenizer.chat_template."): v
        for k, v in meta.items()
        if k.startswith("tokenizer.chat_template.")
    }
    return Tokenizer(
        backend,
        bos_token=named("bos"),
        eos_tokens=[t for t in (named("eos"), named("eot"), named("eom")) if t is not None],
        unk_token=named("unknown"),
        pad_token=named("padding"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),  # llama.cpp's defaults
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        chat_templates=templates,
        vocab_size=len(tokens),
        source=str(path),
    )


# -- chat templates ------------------------------------------------------------------------------------------------


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes HTML characters; chat templates expect plain JSON, as HF renders it
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_template(source: str):
    """A chat template compiled in a sandbox, with the options and helpers HF gives templates."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for HF's training masks; here it
        renders its body and nothing else."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
