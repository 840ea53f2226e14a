"""GGUF vocabularies as HF `tokenizers` objects; incremental detokenization; chat templates."""

from __future__ import annotations

import codecs
import datetime
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .prefix_tokens import CUT_SAFE, PrefixTokens
from .pretokenizers import NAMES, SPLITS

log = logging.getLogger(__name__)

# llama.cpp token types (llama_token_type in gguf metadata `tokenizer.ggml.token_type`).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class GGUFVocab:
    """The tokenizer part of GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    unk_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = True
    chat_template: str | None = None

    @classmethod
    def from_metadata(cls, md: dict) -> GGUFVocab:
        """Args: md: GGUF metadata (key -> value), as GGUFFile.metadata holds it."""
        if "tokenizer.ggml.tokens" not in md:
            raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
        model = md.get("tokenizer.ggml.model", "gpt2")
        tokens = md["tokenizer.ggml.tokens"]
        types = md.get("tokenizer.ggml.token_type")
        scores = md.get("tokenizer.ggml.scores")
        return cls(
            model=model,
            pre=md.get("tokenizer.ggml.pre", "default"),
            tokens=tokens,
            token_types=[int(t) for t in types] if types is not None else [NORMAL] * len(tokens),
            merges=md.get("tokenizer.ggml.merges", []),
            scores=[float(x) for x in scores] if scores is not None else None,
            bos_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_id=md.get("tokenizer.ggml.eos_token_id"),
            eot_id=md.get("tokenizer.ggml.eot_token_id"),
            unk_id=md.get("tokenizer.ggml.unknown_token_id"),
            add_bos=bool(md.get("tokenizer.ggml.add_bos_token", _default_add_bos(model, md))),
            add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(md.get("tokenizer.ggml.add_space_prefix", True)),
            chat_template=md.get("tokenizer.chat_template"),
        )


def _default_add_bos(model: str, md: dict) -> bool:
    """llama.cpp's add_bos where the file says nothing: on for SentencePiece and for the
    pre-tokenizers it turns it on for (Llama 3, Tekken, ...)."""
    if model == "llama":
        return True
    pre = NAMES.get(md.get("tokenizer.ggml.pre", "default"))
    return pre is not None and pre[2]


def _spm_merges(vocab: dict[str, int], scores: list[float], types: list[int]) -> list[tuple]:
    """Merges ranked by the score of the merged piece, as SentencePiece BPE applies them."""
    merges = []
    for piece, pid in vocab.items():
        if types[pid] != NORMAL or len(piece) < 2:
            continue
        local = [
            (piece[:i], piece[i:])
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((lr, scores[pid]) for lr in local)
    merges.sort(key=lambda m: m[1], reverse=True)  # stable: ties keep (left id, right id) order
    return [m[0] for m in merges]


def check_supported(v: GGUFVocab) -> None:
    """Raise ValueError naming the field unless we tokenize this kind of vocabulary."""
    if v.model not in ("gpt2", "llama"):
        raise ValueError(f"unsupported tokenizer.ggml.model {v.model!r}; supported: gpt2, llama")
    if v.model == "gpt2" and v.pre not in NAMES:
        raise ValueError(
            f"unsupported tokenizer.ggml.pre {v.pre!r}; supported: {', '.join(sorted(NAMES))}"
        )


def byte_level_splits(split: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a BPE vocabulary whose `tokenizer.ggml.pre` splits by rule `split`
    (pretokenizers.SPLITS): its regexes in turn, then bytes to GPT-2's printable characters."""
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in SPLITS[split]]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def build_hf_tokenizer(v: GGUFVocab) -> Tokenizer:
    """Build the HF `tokenizers` object that tokenizes as llama.cpp does for this vocabulary."""
    check_supported(v)
    vocab = {tok: i for i, tok in enumerate(v.tokens)}
    if v.model == "gpt2":
        split, ignore_merges, _ = NAMES[v.pre]
        merges = [tuple(m.split(" ", 1)) for m in v.merges]
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
        tok.pre_tokenizer = byte_level_splits(split)
        tok.decoder = decoders.ByteLevel()
    elif v.model == "llama":
        if v.scores is None:
            raise ValueError("SentencePiece GGUF vocabulary has no tokenizer.ggml.scores")
        merges = _spm_merges(vocab, v.scores, v.token_types)
        unk = v.tokens[v.unk_id] if v.unk_id is not None else None
        tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, byte_fallback=True, fuse_unk=True))
        norm = [normalizers.Replace(" ", "▁")]
        if v.add_space_prefix:
            norm.insert(0, normalizers.Prepend("▁"))
        tok.normalizer = normalizers.Sequence(norm)
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if v.add_space_prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(dec)
    # Control tokens are special (skipped in output text); user-defined ones are ordinary text
    # that is always matched whole, as llama.cpp does.
    added = [
        AddedToken(t, special=(ty == CONTROL), normalized=False)
        for t, ty in zip(v.tokens, v.token_types, strict=True)
        if ty in (CONTROL, USER_DEFINED)
    ]
    tok.add_tokens(added)
    return tok


def token_bytes(v: GGUFVocab) -> list[bytes]:
    """The bytes each token contributes to output text (b"" for control tokens).

    Detokenizing by table lookup plus an incremental UTF-8 decoder costs about a microsecond a
    token; two HF decode calls a token cost tens (measured: a third of the host time of a
    32-row decode step).
    """
    out = []
    if v.model == "gpt2":
        inv = {c: b for b, c in enumerate(_byte_chars())}
        for t, ty in zip(v.tokens, v.token_types, strict=True):
            if ty == CONTROL:
                out.append(b"")
            elif ty == USER_DEFINED or any(c not in inv for c in t):
                out.append(t.encode("utf-8"))
            else:
                out.append(bytes(inv[c] for c in t))
    else:  # SentencePiece: ▁ is a space, <0xXX> byte-fallback tokens are raw bytes
        for t, ty in zip(v.tokens, v.token_types, strict=True):
            if ty == CONTROL:
                out.append(b"")
            elif ty == BYTE and len(t) == 6 and t.startswith("<0x"):
                out.append(bytes([int(t[3:5], 16)]))
            else:
                out.append(t.replace("▁", " ").encode("utf-8"))
    return out


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte value, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


class IncrementalDecoder:
    """Turn a stream of token ids into text deltas; never emits a partial UTF-8 character.

    Args:
      tokenizer: the GGUFTokenizer.
      strip_leading_space: drop the space SentencePiece puts before the first token, as
        `decode` does for a standalone text. A continuation of a prompt keeps it.
    """

    def __init__(self, tokenizer: GGUFTokenizer, strip_leading_space: bool = False):
        self.table = tokenizer.token_bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.strip = strip_leading_space and tokenizer.vocab.model == "llama"

    def push(self, token_id: int) -> str:
        text = self.utf8.decode(self.table[token_id])
        if self.strip and text:
            self.strip = False
            if text[0] == " ":
                text = text[1:]
        return text

    def flush(self) -> str:
        """Text still held back at the end of a sequence (an incomplete character)."""
        return self.utf8.decode(b"", final=True)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment HF's apply_chat_template uses."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


class GGUFTokenizer:
    """Encode, decode and chat-format text for one GGUF vocabulary."""

    def __init__(self, vocab: GGUFVocab, chat_template: str | None = None):
        self.vocab = vocab
        self.hf = build_hf_tokenizer(vocab)
        self.bos_id, self.eos_id = vocab.bos_id, vocab.eos_id
        self.vocab_size = len(vocab.tokens)
        self.token_bytes = token_bytes(vocab)
        # End-of-generation ids: EOS, EOT and the control tokens chat models end a turn with.
        eog = {i for i in (vocab.eos_id, vocab.eot_id) if i is not None}
        for name in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|eom_id|>"):
            i = self.hf.token_to_id(name)
            if i is not None and vocab.token_types[i] == CONTROL:
                eog.add(i)
        self.eog_ids = frozenset(eog)
        src = chat_template if chat_template is not None else vocab.chat_template
        self.chat_template = src  # the source (the server reads its tool-call syntax from it)
        self._template = compile_chat_template(src) if src else None
        # long prompts that start like a recent one reuse its ids (prefix_tokens.py)
        self._prefix = None
        if vocab.model == "gpt2" and NAMES[vocab.pre][0] in CUT_SAFE:
            # input bytes per token: its output bytes, or a control token's own text
            triples = zip(vocab.tokens, vocab.token_types, self.token_bytes, strict=True)
            sizes = [len(t.encode("utf-8")) if ty == CONTROL else len(b) for t, ty, b in triples]
            self._prefix = PrefixTokens(self._encode, np.asarray(sizes, np.int64))

    def _encode(self, text: str) -> list[int]:
        """The ids of text, no BOS / EOS added."""
        # encode_batch_fast skips the offsets that encode tracks: 8.2 against 10.5 ms for an
        # 11k-token prompt on 2 CPU cores (a tokenizers without it, as a device image may
        # have, encodes the plain way)
        fast = getattr(self.hf, "encode_batch_fast", None)
        if fast:
            return fast([text], add_special_tokens=False)[0].ids
        return self.hf.encode(text, add_special_tokens=False).ids

    @classmethod
    def from_gguf(cls, path: str | Path, chat_template_file: str | Path | None = None):
        from .gguf import GGUFFile

        tmpl = Path(chat_template_file).read_text() if chat_template_file else None
        return cls(GGUFVocab.from_metadata(GGUFFile(path).metadata), tmpl)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are parsed as such.

        Args:
          add_special: add BOS/EOS as the vocabulary's metadata asks (llama.cpp's add_special).
        """
        ids = self._prefix.encode(text) if self._prefix else self._encode(text)
        if add_special and self.vocab.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_special and self.vocab.add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Render messages to a prompt string as HF's apply_chat_template(tokenize=False) does."""
        if self._template is None:
            raise ValueError("this model has no chat template; pass chat_template_file")
        tokens = self.vocab.tokens
        ctx = {
            "bos_token": tokens[self.bos_id] if self.bos_id is not None else "",
            "eos_token": tokens[self.eos_id] if self.eos_id is not None else "",
            **kwargs,
        }
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **ctx
        )
