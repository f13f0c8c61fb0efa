"""The demo's data and models (distill/embedded): the gensim corpus, its split, the pairs, the phases' texts."""

from __future__ import annotations

from distill import embedded
from distill.embedded import corpus


def test_embedded_train_and_eval_articles_are_disjoint() -> None:
    train, evaluation = corpus.train_articles(), corpus.eval_articles()
    assert train and evaluation
    train_titles, eval_titles = {a.title for a in train}, {a.title for a in evaluation}
    assert not train_titles & eval_titles
    assert len(train) + len(evaluation) == len(corpus.wikipedia_articles())
    assert all(corpus.is_eval_article(a.title) for a in evaluation)
    assert not any(corpus.is_eval_article(a.title) for a in train)
    assert 0.05 < len(evaluation) / (len(train) + len(evaluation)) < 0.4  # about EVAL_FRACTION held out


def test_inverse_cloze_query_not_in_its_passage() -> None:
    queries, passages = corpus.inverse_cloze_pairs(corpus.train_articles(), seed=0)
    assert len(queries) == len(passages) > 100
    for query, passage in zip(queries, passages, strict=True):
        assert len(query.split()) >= 4
        assert query not in passage
    # deterministic per seed
    assert corpus.inverse_cloze_pairs(corpus.train_articles(), seed=0)[0] == queries
    assert corpus.inverse_cloze_pairs(corpus.train_articles(), seed=1)[0] != queries


def test_inverse_cloze_pairs_per_paragraph() -> None:
    articles = corpus.train_articles()
    paragraphs = [tuple(s) for a in articles for s in a.paragraphs if len(s) >= 3]
    owner = {  # every possible (query, passage) pair -> the paragraph it comes from
        (sentences[i], " ".join(s for j, s in enumerate(sentences) if j != i)): number
        for number, sentences in enumerate(paragraphs)
        for i in range(len(sentences))
    }
    one = corpus.inverse_cloze_pairs(articles, seed=3)
    for per_paragraph in (2, 4):
        queries, passages = corpus.inverse_cloze_pairs(articles, seed=3, per_paragraph=per_paragraph)
        assert len(queries) == sum(min(per_paragraph, len(s)) for s in paragraphs)
        # the first round is the one-per-paragraph data, in its order; the rounds after it add to it
        assert (queries[: len(one[0])], passages[: len(one[1])]) == one
        seen: dict[int, list[str]] = {}
        for query, passage in zip(queries, passages, strict=True):
            seen.setdefault(owner[(query, passage)], []).append(query)  # a KeyError: not a real pair
        assert all(len(set(q)) == len(q) == min(per_paragraph, len(paragraphs[n])) for n, q in seen.items())
        assert len(seen) == len(paragraphs)
        # every paragraph appears once before any appears twice
        firsts = {owner[pair] for pair in zip(queries[: len(paragraphs)], passages[: len(paragraphs)])}
        assert len(firsts) == len(paragraphs)


def test_lee_sts_shape() -> None:
    documents, pairs, scores = corpus.lee_sts()
    assert len(documents) == 50
    assert len(pairs) == len(scores) == 1225
    assert pairs[0] == (0, 1) and pairs[-1] == (48, 49)
    assert all(i < j for i, j in pairs)
    assert all(0.0 <= s <= 1.0 for s in scores)


def test_phase1_texts_are_the_wikipedia_sentences_then_the_lee_background_ones() -> None:
    wikipedia = corpus.wikipedia_sentences(corpus.train_articles())
    texts = embedded.phase1_texts()
    assert texts[: len(wikipedia)] == wikipedia and texts[len(wikipedia) :] == corpus.lee_background()
    assert len(corpus.lee_background()) > 2000


def test_phase2_pairs_are_two_rounds_of_inverse_cloze_pairs_every_paragraph_first() -> None:
    queries, passages = embedded.phase2_pairs(seed=5)
    assert (queries, passages) == corpus.inverse_cloze_pairs(corpus.train_articles(), 5, embedded.PAIRS_PER_PARAGRAPH)
    one_round = corpus.inverse_cloze_pairs(corpus.train_articles(), 5)
    assert queries[: len(one_round[0])] == one_round[0] and len(queries) > len(one_round[0])


def test_eval_set_is_held_out_and_carries_lee_sts() -> None:
    queries, passages, relevant, (documents, pairs, scores) = embedded.eval_set(seed=1, max_queries=30)
    assert len(queries) == len(relevant) == 30 and max(relevant) < len(passages)
    train = set(corpus.wikipedia_sentences(corpus.train_articles()))
    assert not set(queries) & train
    assert len(documents) == 50 and len(pairs) == len(scores) == 1225
