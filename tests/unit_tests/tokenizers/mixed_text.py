"""A deterministic text that exercises tokenizers: code, prose, many scripts, odd whitespace, digits."""

import glob
import random
import sysconfig

UNICODE_LINES = [
    "中文分词测试，漢字とひらがなとカタカナ。한국어 문장입니다. 𠀀𪜀 (CJK extension B)",
    "Emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 😀😃 ✨🔥 ❤️",
    "Precomposed: café naïve résumé Ångström façade Žluťoučký kůň; Greek: καλημέρα κόσμε, Ελληνικά",
    "Combining without a precomposed form: q̇ x̧ ɛ̃ ज़िंदगी, Vietnamese: Tiếng Việt có dấu",
    "RTL: مرحبا بالعالم، العربيّة مع تشكيل — שָׁלוֹם עולם! فارسی: سلام",
    "Cyrillic: Съешь же ещё этих мягких французских булок; Thai: ภาษาไทยไม่มีช่องว่าง; Hindi: नमस्ते दुनिया",
    "Digits: 1234567890 3.14159 1,000,000 ٣٤٥ ١٢ ２０２６年 ½ ² Ⅻ",
    "Punctuation: «quotes» „Anführungszeichen“ ‘single’ … — – ¿Qué? ¡Sí! ※ § ¶ † ‡ •",
    "Contractions: don't can't I'm we've they're she'll he'd it's Y'ALL'RE O'Neil's rock'n'roll",
    "Whitespace:   three spaces\tone tab\t\ttwo tabs  \t mixed\u00a0nbsp\u3000ideographic\u2009thin end   ",
    "Line endings: CRLF here\r\nand a lone CR\rand LF\n\n\nthree newlines above",
    "Literal markers (ordinary text for Megatron's BERT): [CLS] [SEP] [MASK] <extra_id_0>",
    "A long word: " + "x" * 150 + " and a longer one: " + "y" * 250,
    "Math: ∑ᵢ xᵢ² ≤ ∞, ∀ε>0 ∃δ; arrows → ⇒ ↔; currency: $5 €3 £2 ¥100 ₹50",
]

_WORDS = (
    "the of and to in is was for that with as on by at from his her they be this which or had not are but "
    "were an have one all their there been has when who will more if no out so said what up its about into "
    "than them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well down"
).split()


def english_prose(rng: random.Random, sentences: int) -> str:
    """Sentences of common words with capitals, commas and final punctuation."""
    out = []
    for _ in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        if len(words) > 6:
            words[rng.randint(2, len(words) - 2)] += ","
        out.append(" ".join(words) + rng.choice([".", ".", ".", "?", "!", "..."]))
    return " ".join(out)


def python_sources(max_chars: int) -> str:
    """The first `max_chars` characters of the standard library's sources, in sorted file order."""
    texts, total = [], 0
    for path in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py")):
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read()
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(texts)[:max_chars]


def mixed_documents(seed: int = 1234) -> list[str]:
    """About 100 KB in ~200 documents mixing Python code, English prose and the unicode lines."""
    rng = random.Random(seed)
    code = python_sources(60_000)
    code_chunks = [code[i : i + 1500] for i in range(0, len(code), 1500)]
    documents = []
    for i, chunk in enumerate(code_chunks):
        documents.append(chunk)
        documents.append(english_prose(rng, 8))
        documents.append(UNICODE_LINES[i % len(UNICODE_LINES)] + "\n" + english_prose(rng, 2))
    documents.append("\n".join(UNICODE_LINES))
    return documents
