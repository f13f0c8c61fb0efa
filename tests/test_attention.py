"""The student's attention paths (distill/students/attention.py): fused MPNet attention and unpadded batches, each
equal to the eager forward and backward, and the decision between them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import sentences, tiny_run_flags
from distill.students import kind_of
from distill.train import main


def tiny_mpnet(seed: int = 0):
    from transformers import MPNetConfig, MPNetModel

    torch.manual_seed(seed)
    config = MPNetConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=80,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return MPNetModel(config)


@pytest.mark.parametrize("training", [False, True])
def test_fused_mpnet_attention_equals_the_eager_forward_and_backward(training):
    """fp32 on a CPU: hidden states and every gradient (the relative position bias's included) within 1e-5, with
    padding in the batch and texts longer than the exact position buckets."""
    from distill.students.attention import use_fused_attention

    eager, fused = tiny_mpnet(), tiny_mpnet()
    assert use_fused_attention(fused) == 1 and use_fused_attention(fused) == 0  # once only
    lengths = torch.tensor([60, 37, 5, 60])
    ids = torch.randint(3, 120, (4, 60))
    mask = (torch.arange(60)[None, :] < lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, 1)
    outputs = []
    for model in (eager, fused):
        model.train(training)
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3)) * mask[..., None]
        (hidden * weights).sum().backward()  # linear in the states: a sum of squares would cancel in LayerNorm
        outputs.append((hidden.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (eager_hidden, eager_grads), (fused_hidden, fused_grads) = outputs
    real = mask.bool()
    assert (eager_hidden[real] - fused_hidden[real]).abs().max() < 1e-5
    assert eager_grads.keys() == fused_grads.keys() and "encoder.relative_attention_bias.weight" in fused_grads
    for name, grad in eager_grads.items():
        if name.endswith("k.bias"):  # a softmax ignores it (it shifts a query's scores alike): its gradient is rounding
            continue
        assert (grad - fused_grads[name]).norm() <= 1e-5 * grad.norm(), name


def test_a_fused_mpnet_student_saves_and_loads_as_plain_mpnet(tmp_path):
    """The switch touches forward methods only: the saved folder loads in plain transformers, same weights."""
    from transformers import AutoModel

    from distill.students.attention import use_fused_attention

    model = tiny_mpnet()
    use_fused_attention(model)
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModel.from_pretrained(tmp_path / "m")
    assert type(loaded.encoder.forward).__name__ == "method"  # transformers' own forward
    ids = torch.randint(3, 120, (2, 9))
    with torch.no_grad():
        assert torch.allclose(
            model(input_ids=ids).last_hidden_state, loaded(input_ids=ids).last_hidden_state, atol=1e-5
        )


def test_unpadded_batches_equal_padded_ones_forward_and_backward(tiny_models, tmp_path):
    """A BERT student on its batch's texts end to end (FlatTexts, each text attending to itself) gives the padded
    batch's sentence vectors and gradients within float32 rounding; padded batches still work after the switch, and
    the saved folder names no custom attention."""
    from distill.students.attention import use_unpadded_batches
    from distill.students.transformer import load_student
    from distill.tokens import FlatTexts, TokenizedTexts

    texts = sentences(12, seed=3)
    padded_student = load_student(str(tiny_models["student"]), attention_dropout=0.0)
    flat_student = load_student(str(tiny_models["student"]), attention_dropout=0.0)
    assert use_unpadded_batches(flat_student) and kind_of(flat_student).texts(flat_student) is not TokenizedTexts
    padded = TokenizedTexts(padded_student.tokenizer, texts, 32)
    flat = kind_of(flat_student).texts(flat_student)(flat_student.tokenizer, texts, 32)
    assert isinstance(flat, FlatTexts) and flat.lengths.min() < flat.lengths.max()  # the batch has padding to drop
    rows = list(range(len(texts)))
    features = flat.features(rows)
    assert features["input_ids"].shape == (1, int(flat.lengths.sum())) == (1, int(features["cu_seq_lens_q"][-1]))
    outputs = []
    for student, batch in ((padded_student, padded.features(rows)), (flat_student, features)):
        student.train()
        vectors = student(dict(batch))["sentence_embedding"]
        weights = torch.randn(vectors.shape, generator=torch.Generator().manual_seed(0))
        (vectors * weights).sum().backward()
        outputs.append((vectors.detach(), {n: p.grad for n, p in student.named_parameters() if p.grad is not None}))
    (padded_vectors, padded_grads), (flat_vectors, flat_grads) = outputs
    assert (padded_vectors - flat_vectors).abs().max() < 1e-5
    assert padded_grads.keys() == flat_grads.keys()
    for name, grad in padded_grads.items():
        if name.endswith("key.bias"):  # a softmax ignores it: its gradient is rounding
            continue
        assert (grad - flat_grads[name]).norm() <= 1e-5 * grad.norm(), name
    with torch.no_grad():  # a padded batch through the switched student: transformers' SDPA path, as before
        again = flat_student.eval()(dict(padded.features(rows)))["sentence_embedding"]
        plain = padded_student.eval()(dict(padded.features(rows)))["sentence_embedding"]
    assert (again - plain).abs().max() < 1e-5
    from sentence_transformers import SentenceTransformer

    flat_student.save(str(tmp_path / "saved"))
    assert "distill" not in (tmp_path / "saved" / "config.json").read_text()
    assert SentenceTransformer(str(tmp_path / "saved"), device="cpu").encode(texts[:2]).shape == (2, 32)


def test_a_run_on_unpadded_batches_follows_the_padded_run(tiny_models, tiny_data, tmp_path, monkeypatch):
    """Both phases, evaluation and export with the student switched to unpadded batches (on a CPU the switch is off,
    so it is forced here): every loss and the exported weights follow the padded run's."""
    from safetensors.torch import load_file

    import distill.students.transformer
    from distill.students.attention import use_unpadded_batches
    from distill.tokens import FlatTexts
    from tests.conftest import reset_accelerate

    def run(out: Path) -> dict:
        reset_accelerate()
        flags = tiny_run_flags(
            tiny_models, tiny_data, out, teacher_cache_dir=tmp_path / "cache", save_to_artifacts=True
        )
        assert main(flags) == 0
        return json.loads((out / "results.json").read_text())

    padded = run(tmp_path / "padded")
    load_student = distill.students.transformer.load_student

    def unpadded(*args, **kwargs):
        student = load_student(*args, **kwargs)
        assert use_unpadded_batches(student)
        return student

    monkeypatch.setattr(distill.students.transformer, "load_student", unpadded)
    batches = []
    features = FlatTexts.features
    monkeypatch.setattr(FlatTexts, "features", lambda self, rows: batches.append(rows) or features(self, rows))
    flat = run(tmp_path / "flat")
    assert len(batches) > 20 + 20  # the training batches of both phases, and the evaluations
    for phase in ("phase1", "phase2"):
        # relative: phase 2's label loss (scale 20, weight 4) makes its losses about 10, at float32 rounding 5e-5
        assert flat["phases"][phase]["losses"] == pytest.approx(padded["phases"][phase]["losses"], rel=1e-4, abs=1e-4)
    assert flat["student_after"]["ndcg@10"] == pytest.approx(padded["student_after"]["ndcg@10"], abs=1e-3)
    weights = [
        load_file(str(out / "artifacts" / "model" / "model.safetensors"))
        for out in (tmp_path / "padded", tmp_path / "flat")
    ]
    moved = max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0])
    assert moved < 1e-3


def tiny_backbone(tiny_models, **config_fields):
    """The tiny BERT student's transformers model, with `config_fields` set on its config."""
    from distill.students.transformer import load_student

    backbone = load_student(str(tiny_models["student"]))[0].auto_model
    for name, value in config_fields.items():
        setattr(backbone.config, name, value)
    return backbone


# Each case changes one condition of a run the variable-length kernel serves (a BERT student, a CUDA GPU of
# compute capability 9.0, bf16 autocast, a torch with the varlen module) and names the reason it then gives.
UNPADDED_RUN = dict(device_type="cuda", mixed_precision="bf16", capability=(9, 0), has_varlen=True)
PADDED_CASES = {
    "no GPU": (dict(device_type="cpu"), "runs on CUDA GPUs, not on cpu"),
    "fp32": (dict(mixed_precision="no"), "takes bf16 or fp16; pass --mixed_precision bf16"),
    "a T4": (dict(capability=(7, 5)), "needs compute capability 8.0+, this GPU has 7.5"),
    "a torch without varlen_attn(scale=)": (
        dict(has_varlen=False),
        "has no torch.nn.attention.varlen.varlen_attn taking scale",
    ),
}


def test_the_attention_decision_is_unpadded_only_where_every_condition_holds(tiny_models):
    from distill.students.attention import attention_path

    backbone = tiny_backbone(tiny_models)
    assert attention_path(backbone, **UNPADDED_RUN).unpadded
    assert attention_path(backbone, **{**UNPADDED_RUN, "mixed_precision": "fp16", "capability": (8, 0)}).unpadded
    for case, (change, reason) in PADDED_CASES.items():
        path = attention_path(backbone, **{**UNPADDED_RUN, **change})
        assert not path.unpadded and reason in path.reason, case


def test_the_attention_decision_keeps_windowed_and_unsupported_models_padded(tiny_models):
    """ModernBERT's local layers (layer_types) or a sliding window would attend globally in the kernel; MPNet takes
    no attention function; a static table has no backbone."""
    from distill.students.attention import attention_path

    windowed = tiny_backbone(tiny_models, layer_types=["full_attention", "sliding_attention"])
    assert "windowed" in attention_path(windowed, **UNPADDED_RUN).reason
    assert not attention_path(tiny_backbone(tiny_models, sliding_window=64), **UNPADDED_RUN).unpadded
    assert attention_path(tiny_backbone(tiny_models, layer_types=["full_attention"] * 4), **UNPADDED_RUN).unpadded
    assert "takes no attention function" in attention_path(tiny_mpnet(), **UNPADDED_RUN).reason
    assert attention_path(None, **UNPADDED_RUN).reason == "the student is no transformer encoder"


def test_choose_attention_switches_the_student_only_when_the_decision_says_so(tiny_models, monkeypatch):
    """On this CPU the student stays padded; with a capable GPU faked, it is switched to unpadded batches and
    the decision is kept on it for results.json."""
    from distill.students import attention
    from distill.students.transformer import load_student
    from distill.tokens import FlatTexts, TokenizedTexts

    student = load_student(str(tiny_models["student"]))
    path = attention.choose_attention(student, torch.device("cpu"), "bf16")
    assert not path.unpadded and kind_of(student).texts(student) is TokenizedTexts and student.attention_path == path
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(attention, "has_varlen", lambda: True)
    assert not attention.choose_attention(student, torch.device("cuda"), "no").unpadded
    path = attention.choose_attention(student, torch.device("cuda"), "bf16")
    assert path.unpadded and student.attention_path.to_dict() == {"unpadded": True, "reason": path.reason}
    assert kind_of(student).texts(student).func is FlatTexts


def test_has_varlen_reads_the_installed_torchs_signature(monkeypatch):
    """torch 2.9's varlen_attn takes no `scale`, which the unpadded attention passes: that torch counts as none."""
    import inspect
    import types

    from distill.students.attention import has_varlen

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 9):
        from torch.nn.attention.varlen import varlen_attn

        assert has_varlen() == ("scale" in inspect.signature(varlen_attn).parameters)

    def torch_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None): ...

    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", types.SimpleNamespace(varlen_attn=torch_2_9))
    assert not has_varlen()
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # no such module: torch before 2.9
    assert not has_varlen()
