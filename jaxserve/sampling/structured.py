"""Structured outputs: grammars compiled against the tokenizer, and the per-step token bitmasks they allow.

The grammar engine is llguidance (a lazy Earley parser with a token-trie lexer, in Rust). It was picked over
xgrammar because it needs no torch at run time (the server's dependencies stay small), compiles a grammar in
about a millisecond (nothing precomputed per vocabulary and schema, so a new schema costs no seconds of
waiting), reads JSON schema, regex, Lark (with JSON schemas embedded as rules) and GBNF, and fills each row's
mask in about a millisecond with the GIL released.

Host side only (no jax). The engine keeps one ``Matcher`` per constrained sequence; before each step it asks
``fill_bitmask`` for the rows that sample, and the sampler turns each packed row (bit ``t % 32`` of word
``t // 32`` = token ``t`` allowed) into -inf on the banned logits.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from jaxserve.core.sampling_params import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 512


# llguidance's words when a grammar outgrows one of its limits (``LLParserLimits``: items in a parser row, the lexer's
# fuel and states, the grammar's size), rather than being wrong or asking for text the vocabulary cannot spell.
_LIMIT_ERROR = re.compile(r"too many |max is \d|fuel|too large|precomputation failed|stack level exceeded", re.I)


class ConstraintUnsatisfiable(ValueError):
    """A constraint that cannot be followed through the request's fault, not the engine's (the server answers 400):
    it asks for text the model's vocabulary cannot produce (e.g. a character whose UTF-8 bytes no token holds), its
    grammar is too large for llguidance's limits, or no finite output satisfies it (a JSON schema's ``$ref`` that
    refers back to itself with no way out)."""


def too_large(kind: str, error: str) -> str | None:
    """The message for llguidance's ``error`` when it means the grammar outgrew a size limit; None otherwise."""
    if not _LIMIT_ERROR.search(error):
        return None
    first = error.strip().splitlines()[0]
    return (
        f"structured_outputs.{kind} is too large: its grammar exceeds a size limit of the grammar engine "
        f"(llguidance: {first}); make it smaller (fewer choices, shorter repetitions)"
    )


def _resolve(root, ref: str):
    """The node a local JSON pointer ``ref`` (``#``, ``#/$defs/a``) names in ``root``; None if it names none."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def endless_refs(schema) -> list[str]:
    """The local ``$ref``s no finite JSON value satisfies, when the schema is one of them ([] when some value is
    valid, as far as references go): ``{"$ref": "#"}``, a definition that is only a reference to itself (or to
    one that refers back), an object that requires a property of its own type. Finds the references that some
    finite value satisfies (a least fixed point: none at first, then those whose target allows a value given the
    others); ``anyOf`` / ``oneOf`` need one member, ``allOf`` all, an object its required properties, an array its
    first ``minItems`` items. Everything else is taken to allow a value."""
    if not isinstance(schema, dict):
        return []
    finite: dict[str, bool] = {}

    def members(node: dict, key: str) -> list:
        value = node.get(key)
        return value if isinstance(value, list) else []

    def ok(node) -> bool:
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and _resolve(schema, ref) is not None and not finite.setdefault(ref, False):
            return False
        if not all(ok(m) for m in members(node, "allOf")):
            return False
        for key in ("anyOf", "oneOf"):
            if members(node, key) and not any(ok(m) for m in members(node, key)):
                return False
        kind = node.get("type")
        if kind in ("object", ["object"]):
            props = node.get("properties")
            props = props if isinstance(props, dict) else {}
            return all(ok(props[p]) for p in members(node, "required") if isinstance(p, str) and p in props)
        if kind in ("array", ["array"]):
            n = node.get("minItems")
            n = n if isinstance(n, int) else 0
            prefix = members(node, "prefixItems")
            if not all(ok(m) for m in prefix[:n]):
                return False
            if n > len(prefix) and "items" in node and not ok(node["items"]):
                return False
        return True

    while not ok(schema):
        grew = [r for r, f in list(finite.items()) if not f and ok(_resolve(schema, r))]
        if not grew:
            return [r for r, f in finite.items() if not f]
        for r in grew:
            finite[r] = True
    return []


def bitmask_width(vocab_size: int) -> int:
    """Words of a packed token bitmask row (32 tokens a word)."""
    return (vocab_size + 31) // 32


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError as e:  # a dependency of jaxserve; only a broken install lacks it
        raise ImportError("structured outputs need the 'llguidance' package: pip install llguidance") from e
    return llguidance


class StructuredOutputs:
    """Compiles ``StructuredOutputsParams`` for one tokenizer, caches the compiled grammars, fills bitmasks.

    Args:
        backend_json: the tokenizer as HF ``tokenizer.json`` text (``tokenizers.Tokenizer.to_str()``).
        vocab_size: the model's vocabulary (logit) size; may exceed the tokenizer's (padding rows are banned).
        eos_token_ids: the tokens that end a sequence; allowed when the grammar is complete.

    The llguidance tokenizer is built on first use (~0.2 s for a 50k vocabulary), so engines that never see a
    constrained request pay nothing. Compiled grammars are kept per canonical grammar text (LRU, 512); a new
    request gets a copy of the compiled matcher in its start state.
    """

    def __init__(self, backend_json: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self._backend_json = backend_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, object] = OrderedDict()
        self.num_compiled = 0  # grammars compiled (cache misses)
        self.compile_seconds = 0.0
        self.fill_seconds = 0.0  # filling bitmasks (host time on the step's path)

    @functools.cached_property
    def _tokenizer(self):
        llg = _llguidance()
        return llg.LLTokenizer(self._backend_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)

    @functools.cached_property
    def _executor(self):
        return _llguidance().LLExecutor()

    def grammar_text(self, so: StructuredOutputsParams) -> str:
        """The llguidance grammar (its JSON form) of a constraint.

        Raises:
            ValueError: the schema is not JSON, or the regex / grammar cannot be translated; the message names
                ``structured_outputs.<kind>``.
        """
        llg = _llguidance()
        kind = so.kind
        try:
            if kind in ("json", "json_object"):
                schema = json.loads(so.json) if kind == "json" else {"type": "object"}
                if not isinstance(schema, (dict, bool)):
                    raise ValueError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
                endless = endless_refs(schema)
                if endless:
                    raise ConstraintUnsatisfiable(
                        f"structured_outputs.json has no valid value: its $ref {', '.join(map(repr, endless))} "
                        "refers back to itself with no way out, so no finite JSON value satisfies the schema"
                    )
                separators = (
                    {"item_separator": ",", "key_separator": ":"}
                    if so.disable_any_whitespace
                    else {"item_separator": ", ", "key_separator": ": "}
                )
                return llg.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema), overrides={"whitespace_flexible": False, **separators}
                )
            if kind == "regex":
                return llg.LLMatcher.grammar_from_regex(so.regex)
            if kind == "choice":
                for i, c in enumerate(so.choice):
                    self._check_producible(c, f"choice[{i}]")
                return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
            return llg.grammar_from("gbnf" if "::=" in so.grammar else "lark", so.grammar)
        except ConstraintUnsatisfiable:
            raise
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {e}") from None

    def _check_producible(self, text: str, where: str) -> None:
        """Raises ConstraintUnsatisfiable if no token sequence spells ``text`` exactly (byte-level vocabularies can
        lack the tokens of some bytes: SmolLM2's has none starting with 0xF1 / 0xF2, i.e. U+40000..U+BFFFF)."""
        tok = self._tokenizer

        def spelled(t: str) -> bool:
            data = t.encode("utf-8", "surrogatepass")
            return tok.decode_bytes(tok.tokenize_bytes(data)) == data

        if spelled(text):
            return
        chars = ", ".join(f"U+{ord(ch):04X}" for ch in [ch for ch in dict.fromkeys(text) if not spelled(ch)][:5])
        raise ConstraintUnsatisfiable(
            f"structured_outputs.{where} cannot be generated: this model's vocabulary has "
            f"no tokens for {chars or 'its bytes'}"
        )

    def compile(self, so: StructuredOutputsParams):
        """The compiled grammar of ``so`` in its start state (cached; do not advance it: ``matcher`` copies it).

        Raises:
            ValueError: the constraint does not compile (names ``structured_outputs.<kind>`` and llguidance's
                reason).
        """
        text = self.grammar_text(so)
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        t0 = time.perf_counter()
        matcher = _llguidance().LLMatcher(self._tokenizer, text, log_level=0)  # releases the GIL while it builds
        if matcher.is_error():
            error = matcher.get_error()
            raise ValueError(too_large(so.kind, error) or f"structured_outputs.{so.kind} cannot be compiled: {error}")
        self._check_start(matcher, so.kind)
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += time.perf_counter() - t0
            self._cache[text] = matcher
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher

    def _check_start(self, matcher, kind: str) -> None:
        """Computes the first mask on a copy of a new grammar: one that outgrows llguidance's limits there, or a
        JSON grammar that allows no value (only the end), is refused now rather than ending a request empty."""
        probe = matcher.deep_copy()
        row = np.zeros(bitmask_width(self.vocab_size), np.int32)
        probe.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if not probe.is_error():
            return
        error = probe.get_error()
        message = too_large(kind, error)
        if message is not None:
            raise ValueError(message)
        if kind in ("json", "json_object"):
            first = error.strip().splitlines()[0]
            raise ConstraintUnsatisfiable(
                f"structured_outputs.{kind} has no valid value: no JSON value satisfies the schema (llguidance: "
                f"{first})"
            )

    def matchers(self, so: StructuredOutputsParams, n: int = 1) -> list[Matcher]:
        """Fresh matchers for ``n`` sequences, from one compile (raises ValueError as ``compile``)."""
        compiled = self.compile(so)
        return [Matcher(compiled.deep_copy(), so.kind) for _ in range(n)]

    def fill_bitmask(self, matchers: Sequence[Matcher]) -> np.ndarray:
        """[len(matchers), bitmask_width(vocab)] int32: each matcher's allowed next tokens, filled in parallel."""
        t0 = time.perf_counter()
        out = np.full((len(matchers), bitmask_width(self.vocab_size)), -1, np.int32)
        for m, row in zip(matchers, out):
            m.mask = row  # kept to tell a grammar the vocabulary cannot follow from a sampler that ignored the mask
        if len(matchers) == 1:
            row = out[0]
            matchers[0].inner.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        elif matchers:
            _llguidance().numpy.fill_next_token_bitmask_par(
                self._executor, [(m.inner, i) for i, m in enumerate(matchers)], out
            )
        self.fill_seconds += time.perf_counter() - t0
        return out


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, inner, kind: str):
        self.inner, self.kind = inner, kind
        self.mask: np.ndarray | None = None  # the packed row of allowed tokens last filled for this sequence

    def advance(self, token_id: int) -> None:
        """Consumes a sampled token.

        Raises:
            ConstraintUnsatisfiable: the grammar has outgrown llguidance's limits (the message says it is too
                large), or it rejects a token its own mask allowed: llguidance's mask lets through the nearest token
                when the text the grammar forces next has bytes no token produces.
            RuntimeError: the grammar rejects a token its mask did not allow (a bug: the sampler ignored the mask);
                the message carries llguidance's reason.
        """
        if self.inner.consume_token(token_id) and not self.inner.is_error():
            return
        self.check()
        reason = self.inner.get_error().strip().splitlines()[0] if self.inner.get_error() else "rejected"
        mask = self.mask
        if mask is not None and 0 <= token_id < 32 * mask.size and (int(mask[token_id // 32]) >> (token_id % 32)) & 1:
            raise ConstraintUnsatisfiable(
                f"structured_outputs.{self.kind} cannot be followed: the text it requires next has characters this "
                f"model's vocabulary has no tokens for ({reason})"
            )
        raise RuntimeError(f"the {self.kind} constraint rejected token {token_id}: {self.inner.get_error()}")

    def check(self) -> None:
        """Raises ConstraintUnsatisfiable if the grammar has outgrown llguidance's limits (its mask then allows
        only the end, or lets a token through that it then rejects): the constraint is too large, not the output
        complete."""
        message = too_large(self.kind, self.inner.get_error() or "") if self.inner.is_error() else None
        if message is not None:
            raise ConstraintUnsatisfiable(message)

    @property
    def done(self) -> bool:
        """True once the grammar can only end: the sequence is finished (the output is complete)."""
        return self.inner.is_stopped()
