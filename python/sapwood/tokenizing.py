"""Running a checkpoint's tokenizer on text (issue 50, case 11). tokenizers is Rust, and a
crafted tokenizer.json can make it panic: a Replace normalizer with an empty pattern loads and
then panics inside encode ("index out of bounds"), a Precompiled normalizer with an empty
charsmap panics while loading. pyo3 raises a panic as PanicException, a BaseException, which
`except Exception` (the server's handlers included) lets through. So: load() checks a tokenizer
with a probe text before it is used (check), and every call that runs it on text goes through
`guarded`, which turns a panic into a ValueError naming the file; KeyboardInterrupt and
SystemExit pass as they are."""
from __future__ import annotations

# ASCII words, digits, punctuation and whitespace, accents, three scripts, an emoji and a
# special-token lookalike: what normalizers and pre-tokenizers treat differently
PROBE = ("Hello, world! It's 2024: 3.14 + 42 = 45.14?\n\t  Über café naïve façade; "
         "日本語のテキスト 한국어 Ελληνικά العربية 🙂👍 <|im_start|>user\nhi<|im_end|>")


class TokenizerError(ValueError):
    """The checkpoint's tokenizer failed (panicked) on a text."""


def is_panic(e: BaseException) -> bool:
    """A Rust panic raised through pyo3 (pyo3_runtime.PanicException, a BaseException). The
    class is not importable before a first panic, so it is known by its name and base."""
    return (type(e).__name__ == "PanicException" and not isinstance(e, Exception)
            and not isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)))


def describe(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else type(e).__name__


def guarded(path, what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), with a tokenizers panic raised as TokenizerError naming `path`
    (the tokenizer.json) and `what` it was doing."""
    try:
        return fn(*args, **kwargs)
    except BaseException as e:
        if not is_panic(e):
            raise
        raise TokenizerError(f"{path}: the tokenizer failed {what} (tokenizers panicked: "
                             f"{describe(e)})") from None


def check(tokenizer, path) -> None:
    """Encode and decode PROBE, as Model.encode / decode do (the tokenizer's own tokens kept
    and not): a tokenizer that panics on ordinary text is refused at load, naming the file."""
    for special in (False, True):
        ids = guarded(path, "encoding a probe text", tokenizer.encode, PROBE,
                      add_special_tokens=special).ids
        guarded(path, "decoding a probe text", tokenizer.decode, ids,
                skip_special_tokens=special)
