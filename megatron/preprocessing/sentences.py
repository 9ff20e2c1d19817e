"""Sentence splitting with nltk's punkt models, as Megatron's `preprocess_data.py --split-sentences` does.

Differences from Megatron, on purpose (its failures here are reported in NVIDIA/Megatron-LM#59):
- nltk is imported only when splitting is asked for, and `check_sentence_splitter` runs in the parent
  before any work starts, so a missing package or model is one clear message, not a crash in a worker.
- Models are read from nltk's `punkt_tab` format (nltk >= 3.9 no longer loads the old pickles) and are
  never downloaded at run time; the message says how to install them.
- Splitting happens inside the encoding workers, in the same pass as tokenization (Megatron writes an
  intermediate `_ss` file and, with `--partitions 1`, needs a second run).
"""

# Megatron splits at most this many characters at a time (very long documents would make punkt slow).
_MAX_CHARS = 1_000_000


def _missing_model_message(lang: str, searched) -> str:
    return (
        f"--split-sentences needs nltk's punkt sentence model for --lang {lang!r}, which is not installed "
        f"(searched {list(searched)}). Install it with:\n"
        f"    python -m nltk.downloader punkt_tab\n"
        f"or point NLTK_DATA at a directory holding tokenizers/punkt_tab/{lang}/."
    )


def _load_params(lang: str):
    try:
        import nltk
        from nltk.tokenize.punkt import load_punkt_params
    except ImportError:
        raise ValueError(
            "--split-sentences needs nltk >= 3.9: pip install nltk (or pip install 'megatron[nlp]')"
        ) from None
    try:
        lang_dir = nltk.data.find(f"tokenizers/punkt_tab/{lang}/")
    except LookupError:
        raise ValueError(_missing_model_message(lang, nltk.data.path)) from None
    return load_punkt_params(lang_dir)


def check_sentence_splitter(lang: str) -> None:
    """Fails fast, in the parent process, when splitting into sentences cannot work."""
    _load_params(lang)


def build_sentence_splitter(lang: str, keep_newlines: bool):
    """Returns `split(text) -> list[str]`.

    With `keep_newlines`, the whitespace (including newlines) after a sentence end stays attached to that
    sentence, so joining the sentences gives back the document (Megatron's `CustomLanguageVars`).
    """
    from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer

    params = _load_params(lang)
    if keep_newlines:

        class KeepNewlinesLanguageVars(PunktLanguageVars):
            _period_context_fmt = r"""
                \S*                          # some word material
                %(SentEndChars)s             # a potential sentence ending
                \s*                          # whitespace, newlines included, stays with the sentence
                (?=(?P<after_tok>
                    %(NonWord)s              # either other punctuation
                    |
                    (?P<next_tok>\S+)        # or the next word
                ))"""

        tokenizer = PunktSentenceTokenizer(params, lang_vars=KeepNewlinesLanguageVars())
    else:
        tokenizer = PunktSentenceTokenizer(params)

    def split(text: str) -> list[str]:
        sentences = []
        for start in range(0, len(text), _MAX_CHARS):
            sentences.extend(tokenizer.tokenize(text[start : start + _MAX_CHARS]))
        return sentences

    return split
