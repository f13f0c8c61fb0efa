"""The demo's text, which ships inside the `gensim` wheel.

- Wikipedia: `enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2` (about 100 articles),
  cleaned with gensim's `extract_pages` + `filter_wiki`, cut into paragraphs and sentences.
- Lee: `lee.cor` (50 news documents) with `similarities0-1.txt` (human similarity of every pair), for STS;
  `lee_background.cor` (300 news texts) as extra general text.

Articles are split into train and evaluation by a hash of their title, so no evaluation paragraph, nor
any sentence of its article, is seen in training.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from distill.errors import DistillError

WIKI_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
EVAL_FRACTION = 0.2
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


@dataclass(frozen=True)
class Article:
    title: str
    paragraphs: tuple[tuple[str, ...], ...]  # each paragraph as its sentences


def gensim_data_dir() -> Path:
    try:
        import gensim
    except ModuleNotFoundError:
        raise DistillError(
            "the embedded demo data ships inside the 'gensim' package, which is not installed; "
            "install it with: pip install 'distill[demo]' (or pip install gensim)"
        ) from None
    return Path(gensim.__file__).parent / "test" / "test_data"


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of a cleaned paragraph; fragments shorter than four words are dropped."""
    text = " ".join(paragraph.replace("''", "").split())  # drop leftover wiki italics/bold quotes
    sentences = (s.strip() for s in _SENTENCE_END.split(text))
    return [s for s in sentences if len(s.split()) >= 4]


@lru_cache(maxsize=1)
def wikipedia_articles() -> tuple[Article, ...]:
    """The shipped Wikipedia articles, cleaned, as paragraphs of sentences."""
    import bz2

    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    articles = []
    with bz2.open(gensim_data_dir() / WIKI_DUMP, "rb") as dump:
        for title, text, _pageid in extract_pages(dump):
            if not text or text.lstrip().lower().startswith("#redirect"):
                continue
            paragraphs = []
            for block in re.split(r"\n\s*\n", filter_wiki(text)):
                sentences = split_sentences(block)
                if sentences:
                    paragraphs.append(tuple(sentences))
            if paragraphs:
                articles.append(Article(title, tuple(paragraphs)))
    return tuple(articles)


def is_eval_article(title: str) -> bool:
    """Deterministic by-article split: about EVAL_FRACTION of the articles are held out."""
    bucket = int(hashlib.sha256(title.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < EVAL_FRACTION


def inverse_cloze_pairs(articles: list[Article], seed: int, per_paragraph: int = 1) -> tuple[list[str], list[str]]:
    """(query, passage) pairs from each paragraph of 3+ sentences: a sentence, and its paragraph without it.

    The first pair of every paragraph comes first (the same pairs whatever `per_paragraph` is); with
    `per_paragraph` > 1, each further round takes another sentence of every paragraph that has one left
    (distinct queries, each with its own passage), shuffled, after the rounds before it. So a cap on the
    number of pairs keeps whole rounds first, and every paragraph is seen before any is seen twice.
    """
    rng, later_rng = random.Random(seed), random.Random(seed + 1)
    rounds: list[list[tuple[str, str]]] = [[] for _ in range(per_paragraph)]
    for article in articles:
        for sentences in article.paragraphs:
            if len(sentences) < 3:
                continue
            first = rng.randrange(len(sentences))
            others = [i for i in range(len(sentences)) if i != first]
            if per_paragraph > 1:
                later_rng.shuffle(others)
            for pairs, pick in zip(rounds, [first, *others]):
                pairs.append((sentences[pick], " ".join(s for i, s in enumerate(sentences) if i != pick)))
    for pairs in rounds[1:]:
        later_rng.shuffle(pairs)
    ordered = [pair for pairs in rounds for pair in pairs]
    return [query for query, _ in ordered], [passage for _, passage in ordered]


def train_articles() -> list[Article]:
    return [a for a in wikipedia_articles() if not is_eval_article(a.title)]


def eval_articles() -> list[Article]:
    return [a for a in wikipedia_articles() if is_eval_article(a.title)]


def wikipedia_sentences(articles: list[Article]) -> list[str]:
    return [s for a in articles for p in a.paragraphs for s in p]


def lee_background() -> list[str]:
    """The 300 Lee background news texts, split into sentences."""
    lines = (gensim_data_dir() / "lee_background.cor").read_text(encoding="utf8", errors="replace").splitlines()
    return [s for line in lines for s in split_sentences(line)]


def lee_sts() -> tuple[list[str], list[tuple[int, int]], list[float]]:
    """Lee's 50 documents and the human similarity of each of their 1,225 pairs (upper triangle)."""
    folder = gensim_data_dir()
    documents = [
        " ".join(line.split())
        for line in (folder / "lee.cor").read_text(encoding="utf8", errors="replace").splitlines()
        if line.strip()
    ]
    rows = [
        [float(v) for v in line.split()]
        for line in (folder / "similarities0-1.txt").read_text().splitlines()
        if line.strip()
    ]
    n = len(rows)
    if len(documents) != n:
        raise DistillError(f"Lee STS data is inconsistent: {len(documents)} documents but a {n}x{n} score matrix")
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    return documents, pairs, [rows[i][j] for i, j in pairs]
