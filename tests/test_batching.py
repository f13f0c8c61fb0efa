"""Tokenize-once features, the length-grouped batch sampler, the collates and sharded mapping."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from sentence_transformers import SentenceTransformer

from conftest import sentences
from distill.batching import LengthGroupedBatchSampler, Phase1Batches, Phase2Batches, make_loader
from distill.errors import OutOfMemory
from distill.sharding import map_sharded
from distill.tokens import MAX_CUT_POINTS, TokenizedTexts, assemble_chunks, length_chunks


@pytest.fixture(scope="module")
def student(tiny_models: dict[str, Path]) -> SentenceTransformer:
    return SentenceTransformer(str(tiny_models["student"]), device="cpu")


def model_features(model: SentenceTransformer, texts: list[str]) -> dict[str, torch.Tensor]:
    features = model.preprocess(texts)
    features.pop("modality", None)
    return features


def assert_same_features(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(theirs)
    for name in theirs:
        assert ours[name].dtype == torch.long, name
        assert torch.equal(ours[name], theirs[name].long()), name


def texts_with_long_ones() -> list[str]:
    long_text = " ".join(["the river music king war state film team game church school world"] * 8)
    return [*sentences(20, seed=3), long_text, "a.", long_text + " stone", "x"]


# ---------------------------------------------------------------- TokenizedTexts


def test_features_equal_the_students_own_preprocessing(student: SentenceTransformer) -> None:
    texts = texts_with_long_ones()
    tokenized = TokenizedTexts(student.tokenizer, texts, student.max_seq_length)
    assert len(tokenized) == len(texts)
    assert_same_features(tokenized.features(list(range(len(texts)))), model_features(student, texts))
    # any subset, in any order, padded to its own longest member
    subset = [3, 0, 22, 21]
    assert_same_features(tokenized.features(subset), model_features(student, [texts[i] for i in subset]))
    short = [0, 1, 23]
    features = tokenized.features(short)
    assert features["input_ids"].shape[1] == int(tokenized.lengths[short].max())
    assert_same_features(features, model_features(student, [texts[i] for i in short]))


def test_truncation_matches_and_is_counted(student: SentenceTransformer) -> None:
    texts = texts_with_long_ones()
    original = student.max_seq_length
    student.max_seq_length = 12
    try:
        tokenized = TokenizedTexts(student.tokenizer, texts, 12)
        expected = model_features(student, texts)
    finally:
        student.max_seq_length = original
    assert tokenized.lengths.max() == 12
    full_lengths = [len(ids) for ids in student.tokenizer(texts)["input_ids"]]
    assert tokenized.truncated == sum(length > 12 for length in full_lengths) >= 2
    assert_same_features(tokenized.features(list(range(len(texts)))), expected)
    # the truncated rows still end with [SEP], as the tokenizer's own truncation does
    sep = student.tokenizer.sep_token_id
    assert all(tokenized.features([i])["input_ids"][0, -1].item() == sep for i in range(len(texts)))


def test_chunked_tokenization_equals_one_chunk(student: SentenceTransformer) -> None:
    texts = texts_with_long_ones()
    whole = TokenizedTexts(student.tokenizer, texts, 16)
    chunked = TokenizedTexts(student.tokenizer, texts, 16, chunk_size=5)
    assert np.array_equal(whole.lengths, chunked.lengths)
    assert np.array_equal(whole.ids, chunked.ids)
    assert whole.truncated == chunked.truncated


def test_left_padding_follows_the_tokenizer(student: SentenceTransformer) -> None:
    import copy

    tokenizer = copy.deepcopy(student.tokenizer)
    tokenizer.padding_side = "left"
    texts = sentences(6, seed=8)
    tokenized = TokenizedTexts(tokenizer, texts, 64)
    expected = tokenizer(texts, padding=True, return_tensors="pt")
    features = tokenized.features(list(range(6)))
    assert torch.equal(features["input_ids"], expected["input_ids"])
    assert torch.equal(features["attention_mask"], expected["attention_mask"])


def test_width_rounded_to_a_multiple_like_the_tokenizers_own_option(student: SentenceTransformer) -> None:
    texts = texts_with_long_ones()
    rounded = TokenizedTexts(student.tokenizer, texts, 64, pad_to_multiple_of=8)
    for subset in ([0, 1, 2], [22, 23], [20, 3], list(range(len(texts)))):
        batch = [texts[i] for i in subset]
        expected = student.tokenizer(
            batch, padding=True, pad_to_multiple_of=8, truncation=True, max_length=64, return_tensors="pt"
        )
        features = rounded.features(subset)
        assert features["input_ids"].shape[1] % 8 == 0
        assert torch.equal(features["input_ids"], expected["input_ids"])
        assert torch.equal(features["attention_mask"], expected["attention_mask"])
    # the padding is masked out: the student's vectors are those of the unrounded batch
    plain = TokenizedTexts(student.tokenizer, texts, 64)
    subset = [next(i for i in range(20) if plain.lengths[i] % 8), 21, 23]  # a width that rounding changes
    with torch.no_grad():
        wide = student(rounded.features(subset))["sentence_embedding"]
        tight = student(plain.features(subset))["sentence_embedding"]
    assert rounded.features(subset)["input_ids"].shape[1] > plain.features(subset)["input_ids"].shape[1]
    torch.testing.assert_close(wide, tight, atol=1e-5, rtol=1e-5)


def test_rounded_width_never_passes_max_length_unless_a_text_does(student: SentenceTransformer) -> None:
    texts = texts_with_long_ones()
    tokenized = TokenizedTexts(student.tokenizer, texts, 12, pad_to_multiple_of=8)
    assert tokenized.lengths.max() == 12
    assert tokenized.features(list(range(len(texts))))["input_ids"].shape[1] == 12  # not 16
    short = [i for i in range(len(texts)) if tokenized.lengths[i] <= 5]
    assert short and tokenized.features(short)["input_ids"].shape[1] == 8


# ---------------------------------------------------------------- sampler


def wide_lengths(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=3.5, sigma=0.9, size=count).astype(int), 3, 512)


def padding_fraction(batches: list[list[int]], lengths: np.ndarray) -> float:
    fractions = [1 - lengths[b].sum() / (len(b) * lengths[b].max()) for b in batches]
    return float(np.mean(fractions))


def test_sampler_is_deterministic_for_seed_and_epoch() -> None:
    lengths = wide_lengths(1000, seed=0)
    first = list(LengthGroupedBatchSampler(lengths, 16, seed=5, megabatch_factor=8))
    second = list(LengthGroupedBatchSampler(lengths, 16, seed=5, megabatch_factor=8))
    assert first == second
    sampler = LengthGroupedBatchSampler(lengths, 16, seed=5, megabatch_factor=8)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch1 != first
    sampler.set_epoch(0)
    assert list(sampler) == first  # the order depends on the epoch number, not on how often it was iterated
    assert list(LengthGroupedBatchSampler(lengths, 16, seed=6, megabatch_factor=8)) != first


@pytest.mark.parametrize(("count", "batch_size"), [(1000, 16), (1001, 16), (37, 8), (64, 64), (10, 16)])
def test_sampler_yields_full_batches_of_distinct_indices(count: int, batch_size: int) -> None:
    sampler = LengthGroupedBatchSampler(wide_lengths(count, seed=1), batch_size, seed=0, megabatch_factor=4)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == count // batch_size
        assert all(len(b) == batch_size for b in batches)
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == len(flat)
        assert all(isinstance(i, int) and 0 <= i < count for i in flat)


def test_sampler_leaves_out_random_samples_not_the_shortest() -> None:
    lengths = wide_lengths(1000, seed=7)  # 15 batches of 64 and 40 samples left out each epoch
    sampler = LengthGroupedBatchSampler(lengths, 64, seed=0)
    seen = np.zeros(1000, dtype=int)
    for epoch in range(20):
        sampler.set_epoch(epoch)
        for batch in sampler:
            seen[batch] += 1
    assert seen.min() >= 1  # every sample trained on in some epoch, the shortest ones too
    shortest, longest = np.argsort(lengths, kind="stable")[:100], np.argsort(lengths, kind="stable")[-100:]
    assert abs(seen[shortest].mean() - seen[longest].mean()) < 1.5  # of 20 epochs: no length left out more


def test_sampler_groups_similar_lengths() -> None:
    lengths = wide_lengths(4096, seed=2)
    batches = list(LengthGroupedBatchSampler(lengths, 32, seed=0))
    grouped = padding_fraction(batches, lengths)
    order = np.random.default_rng(0).permutation(len(lengths))
    random_batches = [order[i : i + 32].tolist() for i in range(0, len(order), 32)]
    shuffled = padding_fraction(random_batches, lengths)
    assert shuffled > 0.5
    assert grouped < 0.1
    assert grouped < shuffled / 5


def test_sampler_batches_are_not_sorted_globally() -> None:
    lengths = wide_lengths(2048, seed=3)
    batches = list(LengthGroupedBatchSampler(lengths, 16, seed=1, megabatch_factor=4))
    longest = [lengths[b].max() for b in batches]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def test_sampler_starts_every_epoch_with_its_widest_batch() -> None:
    lengths = wide_lengths(2048, seed=4)
    sampler = LengthGroupedBatchSampler(lengths, 16, seed=2, megabatch_factor=4)
    firsts = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        widths = [int(lengths[b].max()) for b in batches]
        assert widths[0] == max(widths)  # a batch size too large for memory fails at step 1
        assert widths[1:] != sorted(widths[1:], reverse=True)  # the rest stays shuffled
        firsts.append(batches[0])
    assert len({tuple(b) for b in firsts}) > 1  # which texts form the widest batch changes with the epoch


# ---------------------------------------------------------------- collates and loader


def test_phase1_loader_batches(student: SentenceTransformer) -> None:
    texts = sentences(40, seed=6)
    tokenized = TokenizedTexts(student.tokenizer, texts, 32)
    teacher = np.random.default_rng(0).standard_normal((40, 48)).astype(np.float16)
    loader = make_loader(tokenized.lengths, 8, seed=3, collate=Phase1Batches(tokenized, teacher))
    batches = list(loader)
    assert len(batches) == 5
    seen = []
    for batch in batches:
        assert batch["teacher"].dtype == torch.float32 and batch["teacher"].shape == (8, 48)
        assert batch["texts"]["input_ids"].shape[0] == 8
        # recover which rows the batch holds from the teacher vectors, and check the texts match them
        rows = [int(np.argmin(np.abs(teacher.astype(np.float32) - v.numpy()).sum(axis=1))) for v in batch["teacher"]]
        seen += rows
        assert_same_features(batch["texts"], model_features(student, [texts[i] for i in rows]))
    assert sorted(seen) == list(range(40))


def test_phase2_collate_orders_positives_then_negatives(student: SentenceTransformer) -> None:
    queries = [f"query {i}." for i in range(4)]
    passages = [f"positive {i}." for i in range(4)] + [f"negative {i} {j}." for i in range(4) for j in range(2)]
    passage_rows = np.array([[i, 4 + 2 * i, 5 + 2 * i] for i in range(4)])
    teacher_queries = np.arange(4, dtype=np.float16)[:, None].repeat(3, axis=1)
    teacher_passages = np.arange(12, dtype=np.float16)[:, None].repeat(3, axis=1)
    collate = Phase2Batches(
        TokenizedTexts(student.tokenizer, queries, 32),
        TokenizedTexts(student.tokenizer, passages, 32),
        passage_rows,
        teacher_queries,
        teacher_passages,
    )
    batch = collate([2, 0])
    assert batch["teacher_queries"][:, 0].tolist() == [2.0, 0.0]
    # positives of the batch's queries first, then each query's negatives in query order
    expected_rows = [2, 0, 8, 9, 4, 5]
    assert batch["teacher_passages"][:, 0].tolist() == [float(r) for r in expected_rows]
    assert batch["passages"].keys() == {"chunks"} and len(batch["passages"]["chunks"]) == 1  # one chunk by default
    assert_same_features(batch["passages"]["chunks"][0], model_features(student, [passages[r] for r in expected_rows]))
    assert_same_features(batch["queries"]["chunks"][0], model_features(student, [queries[2], queries[0]]))


# ---------------------------------------------------------------- forward chunks of similar length


def brute_force_tokens(lengths: np.ndarray, chunks: int) -> int:
    """Fewest padded tokens of any split of the sorted lengths into exactly `chunks` contiguous groups."""
    from itertools import combinations

    s = np.sort(lengths)[::-1]
    best = None
    for cuts in combinations(range(1, len(s)), chunks - 1):
        bounds = [0, *cuts, len(s)]
        tokens = sum((b - a) * int(s[a]) for a, b in zip(bounds[:-1], bounds[1:]))
        best = tokens if best is None else min(best, tokens)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_length_chunks_pad_as_little_as_any_split(seed: int) -> None:
    lengths = np.random.default_rng(seed).integers(3, 120, size=11)
    for max_chunks in (2, 3):
        chunks = length_chunks(lengths, max_chunks, min_saving=0.0)
        assert sorted(np.concatenate(chunks).tolist()) == list(range(len(lengths)))  # every row once
        tokens = sum(len(c) * int(lengths[c].max()) for c in chunks)
        assert tokens == brute_force_tokens(lengths, len(chunks))
        assert len(chunks) == max_chunks  # with no saving required, every allowed chunk is used
        assert tokens <= min(brute_force_tokens(lengths, c) for c in range(1, max_chunks + 1))


def test_length_chunks_split_only_where_it_saves_enough() -> None:
    alike = np.array([40, 41, 39, 40, 42, 40, 38, 41])  # one chunk pads 5% at most: no split
    assert [c.tolist() for c in length_chunks(alike, 4)] == [list(range(8))]  # one chunk keeps the given order
    two_kinds = np.array([100, 10, 98, 12, 11, 99, 10, 100])  # two chunks halve the tokens; a third saves < 5%
    chunks = length_chunks(two_kinds, 4)
    assert sorted(sorted(c.tolist()) for c in chunks) == [[0, 2, 5, 7], [1, 3, 4, 6]]
    assert length_chunks(two_kinds, 1)[0].tolist() == list(range(8))
    assert [c.tolist() for c in length_chunks(np.array([7]), 4)] == [[0]]


def test_length_chunks_of_a_large_batch_cut_on_a_coarser_grid() -> None:
    lengths = np.random.default_rng(7).integers(4, 129, size=4 * MAX_CUT_POINTS + 3)  # 1,027 rows: every 5th cut
    chunks = length_chunks(lengths, 4)
    assert 1 < len(chunks) <= 4
    assert sorted(np.concatenate(chunks).tolist()) == list(range(len(lengths)))
    step = -(-len(lengths) // MAX_CUT_POINTS)
    assert all(len(c) % step == 0 for c in chunks[:-1])  # chunks start and end on the grid (the last at the end)
    tokens = sum(len(c) * int(lengths[c].max()) for c in chunks)
    assert tokens < 0.75 * len(lengths) * int(lengths.max())


def test_chunked_features_reassemble_in_the_asked_order(student: SentenceTransformer) -> None:
    texts = texts_with_long_ones()
    tokenized = TokenizedTexts(student.tokenizer, texts, student.max_seq_length)
    indices = [21, 0, 23, 20, 5, 22, 1]  # long and short texts interleaved
    chunked = tokenized.chunked_features(indices, max_chunks=3)
    assert len(chunked["chunks"]) > 1
    padded = sum(f["input_ids"].numel() for f in chunked["chunks"])
    assert padded < tokenized.features(indices)["input_ids"].numel()
    student.eval()
    with torch.no_grad():
        parts = [student(dict(f))["sentence_embedding"] for f in chunked["chunks"]]
        whole = student(dict(tokenized.features(indices)))["sentence_embedding"]
    # the same vectors, row for row, as one padded batch (padding changes nothing but float rounding)
    torch.testing.assert_close(assemble_chunks(parts, chunked), whole, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(assemble_chunks(parts, {"chunks": parts}), whole, atol=1e-3)  # order did move


def test_phase2_collate_chunks_queries_and_passages_by_length(student: SentenceTransformer) -> None:
    queries = ["short one.", " ".join(["a much longer query about the river and the king"] * 4), "tiny.", "x y."]
    passages = [" ".join([f"passage {i} about war and state and film"] * (1 + 5 * (i % 2))) for i in range(4)]
    tokenized_queries = TokenizedTexts(student.tokenizer, queries, 64)
    tokenized_passages = TokenizedTexts(student.tokenizer, passages, 64)
    rows = np.arange(4)[:, None]
    teacher = np.eye(4, dtype=np.float16)
    batch = Phase2Batches(tokenized_queries, tokenized_passages, rows, teacher, teacher, max_chunks=4)([0, 1, 2, 3])
    for name, texts in (("queries", queries), ("passages", passages)):
        chunked = batch[name]
        assert len(chunked["chunks"]) > 1, name
        ids = torch.cat([f["input_ids"][:, :3] for f in chunked["chunks"]])[chunked["restore"]]
        expected = model_features(student, texts)["input_ids"][:, :3]
        assert torch.equal(ids, expected.long()), name  # restore puts each text back in its row
    assert batch["teacher_queries"].tolist() == teacher.astype(np.float32).tolist()  # teacher rows not reordered


def test_map_sharded_returns_rows_in_input_order(accelerator: Accelerator) -> None:
    lengths = wide_lengths(50, seed=4)
    calls: list[list[int]] = []

    def encode(indices: list[int]) -> torch.Tensor:
        calls.append(indices)
        return torch.tensor([[i, 2 * i] for i in indices], dtype=torch.float64)

    out = map_sharded(accelerator, lengths, 8, encode, chunk_size=16)
    assert out.dtype == np.float32 and out.shape == (50, 2)
    assert np.array_equal(out[:, 0], np.arange(50)) and np.array_equal(out[:, 1], 2 * np.arange(50))
    assert all(len(c) <= 8 for c in calls)
    assert sorted(i for c in calls for i in c) == list(range(50))
    # longest first within each chunk of 16
    order = [i for c in calls for i in c]
    for start in range(0, 50, 16):
        chunk = lengths[order[start : start + 16]]
        assert list(chunk) == sorted(chunk, reverse=True)


def test_map_sharded_prepares_the_next_batch_in_the_background(accelerator: Accelerator) -> None:
    import threading

    lengths = wide_lengths(50, seed=4)
    prepared_in: set[str] = set()

    def prepare(indices: list[int]) -> torch.Tensor:
        prepared_in.add(threading.current_thread().name)
        return torch.tensor([[i, 2 * i] for i in indices], dtype=torch.float64)

    plain = map_sharded(accelerator, lengths, 8, lambda indices: prepare(indices), chunk_size=16)
    prepared_in.clear()
    encoded: list[int] = []

    def encode(batch: torch.Tensor) -> torch.Tensor:
        encoded.append(len(batch))
        return batch

    ahead = map_sharded(accelerator, lengths, 8, encode, chunk_size=16, prepare=prepare)
    assert np.array_equal(ahead, plain) and np.array_equal(ahead[:, 0], np.arange(50))
    assert sum(encoded) == 50 and all(n <= 8 for n in encoded)
    assert prepared_in and threading.current_thread().name not in prepared_in  # never on the caller's thread

    def broken(indices: list[int]) -> torch.Tensor:
        raise ValueError("tokenizer says no")

    with pytest.raises(ValueError, match="tokenizer says no"):  # raised to the caller, not lost in the thread
        map_sharded(accelerator, lengths, 8, encode, chunk_size=16, prepare=broken)


def out_of_memory_above(limit: int, calls: list[int]) -> Callable[[list[int]], torch.Tensor]:
    """An encode that, like a GPU, fails on batches of more than `limit` items (torch's error and message)."""

    def encode(indices: list[int]) -> torch.Tensor:
        calls.append(len(indices))
        if len(indices) > limit:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
                "1.05 GiB is free. Including non-PyTorch memory, this process has 78.04 GiB memory in use."
            )
        return torch.tensor([[i, 2 * i] for i in indices], dtype=torch.float32)

    return encode


@pytest.mark.parametrize("ahead", [False, True])
def test_map_sharded_halves_the_batches_when_the_device_runs_out_of_memory(
    accelerator: Accelerator, ahead: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch too large for the device: it and every later batch are split, and every row still comes back."""
    lengths = wide_lengths(50, seed=4)
    calls: list[int] = []
    encode = out_of_memory_above(3, calls)
    kwargs = {"prepare": lambda indices: list(indices)} if ahead else {}
    with caplog.at_level("WARNING"):
        out = map_sharded(accelerator, lengths, 8, encode, chunk_size=16, **kwargs)
    assert np.array_equal(out[:, 0], np.arange(50)) and np.array_equal(out[:, 1], 2 * np.arange(50))
    # 8 fails, 4 fails, then 2 fits; after that no batch is tried above 2 (nor re-tried at 8)
    assert calls[:3] == [8, 4, 2] and max(calls[3:]) == 2 and sum(calls[2:]) == 50
    warnings = [r.getMessage() for r in caplog.records if "out of device memory" in r.getMessage()]
    assert len(warnings) == 2 and "batches of at most 4" in warnings[0] and "batches of at most 2" in warnings[1]
    assert "Tried to allocate 2.00 GiB" in warnings[0]


def test_map_sharded_reports_a_single_item_that_does_not_fit(accelerator: Accelerator) -> None:
    calls: list[int] = []
    with pytest.raises(OutOfMemory) as raised:
        map_sharded(
            accelerator, wide_lengths(20, seed=1), 8, out_of_memory_above(0, calls), too_long_hint="lower --max_len"
        )
    assert calls == [8, 4, 2, 1]
    message = str(raised.value)
    assert message.startswith("out of device memory encoding a single text (CUDA out of memory. Tried to allocate")
    assert message.endswith("; lower --max_len") and "\n" not in message


def test_token_budget_batches_fit_the_budget_and_keep_their_sizes_every_epoch() -> None:
    """fairseq-style: each global batch is at most budget x processes padded tokens (a text wider than the budget
    still gets one row per process), a multiple of the process count, the same sizes every epoch, no text twice."""
    from distill.batching import TokenBudgetBatchSampler

    widths = np.random.default_rng(0).integers(4, 120, size=1000)
    sampler = TokenBudgetBatchSampler(widths, budget=512, processes=2, seed=3)
    sizes = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = [[row for group in batch for row in group] for batch in sampler]
        assert len(batches) == len(sampler)
        sizes.append(sorted(len(b) for b in batches))
        for batch in batches:
            assert len(batch) % 2 == 0
            assert len(batch) * widths[batch].max() <= 1024 or len(batch) == 2
        seen = [row for batch in batches for row in batch]
        assert len(seen) == len(set(seen)) and len(seen) > 1000 - 2
        tokens = [len(b) * widths[b].max() for b in batches]
        assert tokens[0] == max(tokens)  # the batch with the most tokens first: a budget too large fails at once
    assert sizes[0] == sizes[1] == sizes[2]
    assert max(sizes[0]) > 4 * min(sizes[0])  # short texts in large batches, long ones in small
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first


def test_each_process_collates_its_own_group_of_a_token_budget_batch() -> None:
    """Accelerate's split hands each process `batch_size` (= process count) items: one group of rows each."""
    from accelerate.data_loader import BatchSamplerShard

    from distill.batching import GroupedCollate, TokenBudgetBatchSampler

    widths = np.random.default_rng(1).integers(4, 60, size=300)
    sampler = TokenBudgetBatchSampler(widths, budget=256, processes=2, seed=0)
    whole = list(sampler)
    shards = [list(BatchSamplerShard(sampler, 2, rank, split_batches=True)) for rank in (0, 1)]
    collate = GroupedCollate(lambda rows: rows)
    for batch, part0, part1 in zip(whole, *shards):
        assert collate(part0) + collate(part1) == [row for group in batch for row in group]
        assert len(collate(part0)) == len(collate(part1))
    assert len(shards[0]) == len(whole)


def byte_level_bpe() -> object:
    """A byte-level BPE tokenizer with a template that adds <s> and </s>, as RoBERTa-family models have."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=alphabet)
    backend.train_from_iterator(sentences(300, seed=3), trainer)
    specials = [("<s>", backend.token_to_id("<s>")), ("</s>", backend.token_to_id("</s>"))]
    backend.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.mark.parametrize("split_special_tokens", [False, True])
def test_the_backends_ids_are_the_ids_transformers_gives(tiny_models, split_special_tokens) -> None:
    """The pass asks the `tokenizers` backend itself (no offsets, no masks as Python lists, 0.6x the time): for a
    WordPiece and a byte-level BPE tokenizer, each text's ids are those of transformers' own call, truncated alike,
    special tokens in the text split or kept as transformers would. transformers' next call truncates as it asks."""
    wordpiece = SentenceTransformer(str(tiny_models["student"]), device="cpu").tokenizer
    texts = [*sentences(40, seed=9), "", "<s> river </s> [CLS] stone [SEP]", "naïve café 東京 🙂", "word " * 50]
    for tokenizer in (wordpiece, byte_level_bpe()):
        tokenizer.split_special_tokens = split_special_tokens
        tokenized = TokenizedTexts(tokenizer, texts, 16)
        expected = tokenizer(texts, truncation=True, max_length=16)["input_ids"]
        for i, ids in enumerate(expected):
            assert tokenized.ids[tokenized.offsets[i] : tokenized.offsets[i + 1]].tolist() == ids, (i, texts[i])
        assert tokenized.truncated == sum(len(tokenizer(text)["input_ids"]) > 16 for text in texts) > 0
        assert [len(ids) for ids in tokenizer(texts[-3:], truncation=True, max_length=4)["input_ids"]] == [4, 4, 4]
