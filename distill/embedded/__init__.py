"""The embedded demo: data and models that ship inside PyPI packages, so a run needs no internet.

The core reaches it by the name `embedded` (`--phase1_data embedded`, `--phase2_data embedded`,
`--eval_data embedded`) and imports it only then; it never changes behaviour because a demo package is
installed.

- `phase1_texts`: the sentences of the training articles of the Wikipedia dump in the `gensim` wheel, then
  the sentences of its 300 Lee background news texts (corpus.py).
- `phase2_pairs`: two inverse-cloze pairs from each training paragraph of 3+ sentences (a sentence as the
  query, its paragraph without it as the passage).
- `eval_set`: inverse-cloze retrieval over the held-out articles (split by article), and the Lee STS pairs.
- models.py: all-MiniLM-L6-v2 and all-mpnet-base-v2 from PyPI packages, for `distill.hub.resolve_model`.
"""

from __future__ import annotations

import random

from distill.embedded import corpus

NAME = "embedded"
PAIRS_PER_PARAGRAPH = 2  # fresh queries beat a second epoch over the same pairs (docs/QUALITY.md)
DESCRIPTIONS = {  # how the model card names the data
    "phase1": "Wikipedia and Lee news sentences from gensim's test data",
    "phase2": "Wikipedia inverse-cloze pairs from gensim's test data",
}


def phase1_texts() -> list[str]:
    """The training articles' sentences, then the Lee background sentences (a cap keeps Wikipedia first)."""
    return corpus.wikipedia_sentences(corpus.train_articles()) + corpus.lee_background()


def phase2_pairs(seed: int) -> tuple[list[str], list[str]]:
    """(queries, passages): inverse-cloze pairs of the training articles, every paragraph's first pair first."""
    return corpus.inverse_cloze_pairs(corpus.train_articles(), seed, PAIRS_PER_PARAGRAPH)


def eval_set(
    seed: int, max_queries: int
) -> tuple[list[str], list[str], list[int], tuple[list[str], list[tuple[int, int]], list[float]]]:
    """(queries, corpus, each query's corpus row, Lee STS as (documents, pairs, scores)) of the held-out articles."""
    queries, passages = corpus.inverse_cloze_pairs(corpus.eval_articles(), seed)
    chosen = sorted(random.Random(seed).sample(range(len(queries)), min(max_queries, len(queries))))
    return [queries[i] for i in chosen], passages, chosen, corpus.lee_sts()
