"""Config resolution: defaults < YAML (--config) < flags, error messages, validation, round trip, --help."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from distill import config as config_module
from distill.config import Config, build_config, build_parser, dump_config, load_config, to_flat_dict
from distill.errors import DistillError


def write_yaml(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def test_defaults_without_arguments() -> None:
    config = load_config([])
    assert config == Config()
    assert config.training.batch_size == 64
    assert config.phase1.epochs == 1 and config.phase1.lr == pytest.approx(2e-5)
    assert config.phase2.epochs == 3 and config.phase2.lr == pytest.approx(5e-6)
    assert config.mode.use_projection is True
    assert config.training.skip_phase1 is False
    assert config.mode.matryoshka_dims is None


def test_yaml_overrides_defaults_and_flags_override_yaml(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "run.yaml",
        {"batch_size": 16, "phase1_lr": 1e-4, "phase2_epochs": 5, "seed": 3, "use_projection": False},
    )
    from_yaml = load_config(["--config", str(path)])
    assert from_yaml.training.batch_size == 16
    assert from_yaml.phase1.lr == pytest.approx(1e-4)
    assert from_yaml.phase2.epochs == 5
    assert from_yaml.training.seed == 3
    assert from_yaml.mode.use_projection is False
    # untouched keys keep their defaults
    assert from_yaml.phase2.lr == pytest.approx(5e-6)
    assert from_yaml.training.warmup_ratio == pytest.approx(0.1)

    both = load_config(["--config", str(path), "--batch_size", "8", "--phase2_epochs", "2"])
    assert both.training.batch_size == 8
    assert both.phase2.epochs == 2
    assert both.phase1.lr == pytest.approx(1e-4)  # from the YAML, no flag given
    assert both.training.seed == 3

    # the order of --config among the flags does not matter: flags still win
    flags_first = load_config(["--batch_size", "8", "--config", str(path)])
    assert flags_first.training.batch_size == 8


def test_phase_flags_set_their_own_phase() -> None:
    config = load_config(["--phase1_lr", "0.001", "--phase2_lr", "0.0002", "--phase1_epochs", "4"])
    assert config.phase1.lr == pytest.approx(1e-3)
    assert config.phase2.lr == pytest.approx(2e-4)
    assert config.phase1.epochs == 4
    assert config.phase2.epochs == 3


def test_flag_with_equals_sign() -> None:
    assert load_config(["--batch_size=12"]).training.batch_size == 12


def test_unknown_flag_names_closest_valid_key() -> None:
    with pytest.raises(DistillError, match=r"unknown argument '--phase1_lrr'.*did you mean 'phase1_lr'"):
        load_config(["--phase1_lrr", "0.1"])
    with pytest.raises(DistillError, match=r"unknown argument '--batchsize=4'; did you mean 'batch_size'"):
        load_config(["--batchsize=4"])


def test_unknown_flag_far_from_everything_points_to_help() -> None:
    with pytest.raises(DistillError, match=r"unknown argument '--zzzzzzzzzzzz'.*--help"):
        load_config(["--zzzzzzzzzzzz", "1"])


def test_every_unknown_flag_is_reported_with_the_other_problems(tmp_path: Path) -> None:
    """One run of the command shows every mistake: each unknown flag, a stray value, a missing YAML, bad values."""
    argv = ["--phase1_lrr", "1", "--batchsize=4", "--config", str(tmp_path / "nope.yaml"), "--seed", "abc"]
    with pytest.raises(DistillError) as info:
        load_config([*argv, "--phase2_lr", "-1", "--skip_phase1", "True", "extra"])
    message = str(info.value)
    for expected in (
        "unknown argument '--phase1_lrr'; did you mean 'phase1_lr'?",
        "unknown argument '--batchsize=4'; did you mean 'batch_size'?",
        "config file '" + str(tmp_path / "nope.yaml") + "' does not exist",
        "seed: expected int, got 'abc'",
        "phase2_lr: expected a number greater than 0, got -1.0",
        "unexpected value 'extra': it follows no flag",
    ):
        assert expected in message
    assert "'1'" not in message  # the unknown flag's own value is not a second problem


def test_a_flag_without_its_value_is_one_line_not_a_usage_dump() -> None:
    with pytest.raises(DistillError, match=r"^argument --teacher_model: expected one argument; give the flag its"):
        load_config(["--teacher_model"])
    assert load_config(["--teacher_query_prompt=-x"]).teacher.teacher_query_prompt == "-x"


def test_unknown_yaml_key_names_closest_valid_key(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "typo.yaml", {"lerning_rate": 1, "phase2_epoch": 2})
    with pytest.raises(DistillError, match=r"unknown config key 'phase2_epoch'; did you mean 'phase2_epochs'"):
        load_config(["--config", str(path)])


def test_yaml_nested_in_sections_says_the_file_is_flat(tmp_path: Path) -> None:
    """The dataclass tree has sections; a YAML written after it is told the flat names to use instead."""
    path = tmp_path / "nested.yaml"
    path.write_text("phase1:\n  lr: 1.0e-4\n  epochs: 2\nteacher:\n  teacher_model: x\n")
    with pytest.raises(DistillError) as info:
        load_config(["--config", str(path)])
    message = str(info.value)
    assert "config key 'phase1' is a section of the config tree, but the YAML file takes flat flag names" in message
    assert "write phase1_lr: ..., phase1_epochs: ... at the top level" in message
    assert "write teacher_model: ... at the top level" in message
    assert "did you mean" not in message


def test_unknown_yaml_key_via_build_config() -> None:
    with pytest.raises(DistillError, match=r"unknown config key 'teacher_modle'; did you mean 'teacher_model'"):
        build_config({"teacher_modle": "x"})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch_size", "0"], r"batch_size: expected a number greater than 0, got 0"),
        (["--push_to_hub", "me/my student"], r"push_to_hub: expected a Hub repository id like your-name/my-stu"),
        (["--push_to_hub", "a/b/c"], r"push_to_hub: expected a Hub repository id"),
        (["--phase1_lr", "-0.001"], r"phase1_lr: expected a number greater than 0, got -0\.001"),
        (["--phase2_epochs", "0"], r"phase2_epochs: expected a number greater than 0, got 0"),
        (["--mixed_precision", "fp8"], r"mixed_precision: expected one of no/fp16/bf16/auto, got 'fp8'"),
        (["--lr_scaling", "cubic"], r"lr_scaling: expected one of none/linear/sqrt, got 'cubic'"),
        (["--batch_size", "eight"], r"batch_size: expected int, got 'eight'"),
        (["--seed", "1.5"], r"seed: expected int, got '1\.5'"),
        (["--phase1_lr", "fast"], r"phase1_lr: expected float, got 'fast'"),
        (["--skip_phase1", "maybe"], r"skip_phase1: expected True or False, got 'maybe'"),
        (["--use_projection", "yes please"], r"use_projection: expected True or False"),
        (["--warmup_ratio", "1.0"], r"warmup_ratio: expected a fraction in \[0, 1\)"),
        (["--weight_decay", "-1"], r"weight_decay: expected a number >= 0"),
        (["--student_num_layers", "0"], r"student_num_layers: expected a positive integer or nothing"),
        (["--matryoshka_dims", "384,-2"], r"matryoshka_dims: expected positive integers"),
        (
            ["--matryoshka_dims", "64,32"],
            r"matryoshka_dims: applies only to Matryoshka mode; pass --use_projection False or drop",
        ),
        (["--matryoshka_dims", "384,big"], r"matryoshka_dims: expected a list of integers"),
        (["--batch_size", "none"], r"batch_size: expected int, got 'none'"),
        (["--seed", "-1"], r"seed: expected an integer from 0 to 4294967295, got -1"),
        (["--seed", str(2**32)], r"seed: expected an integer from 0 to 4294967295, got 4294967296"),
        (["--ddp_timeout", "0"], r"ddp_timeout: expected a positive number of seconds, got 0"),
        (["--output_dir", " "], r"output_dir: expected a folder, got an empty value; pass --output_dir"),
        (["--keep_best"], r"keep_best: .* but eval_steps is 0 \(only phase ends\); pass --eval_steps N or drop"),
        (
            ["--keep_best", "--eval_steps", "50", "--eval_data", "none"],
            r"keep_best: .* but eval_data is none; pass --eval_steps N and an --eval_data or drop --keep_best",
        ),
        (["--skip_phase1", "--skip_phase2"], r"skip_phase1 and skip_phase2 are both set"),
        (
            ["--phase1_teacher_model", "student/source"],
            r"phase1_teacher_model: applies only to Matryoshka mode; pass --use_projection False or drop",
        ),
        (
            ["--phase1_teacher_model", "student/source", "--use_projection", "False", "--skip_phase2"],
            r"phase1_teacher_model: .* needs both phases; drop --phase1_teacher_model or --skip_phase1 / --skip_phase2",
        ),
        (["--ddp_comm_hook", "powersgd"], r"ddp_comm_hook: expected one of none/fp16/bf16, got 'powersgd'"),
        (["--gradient_checkpointing", "sometimes"], r"gradient_checkpointing: expected True or False"),
        (["--pad_to_multiple_of", "0"], r"pad_to_multiple_of: expected a number greater than 0, got 0"),
    ],
)
def test_invalid_values_are_rejected(argv: list[str], message: str) -> None:
    with pytest.raises(DistillError, match=message):
        load_config(argv)


def test_gpu_training_options() -> None:
    config = load_config([])
    assert not config.performance.torch_compile and not config.performance.gradient_checkpointing
    assert config.performance.ddp_comm_hook == "none"
    config = load_config(["--torch_compile", "--gradient_checkpointing", "--ddp_comm_hook", "bf16"])
    assert config.performance.torch_compile and config.performance.gradient_checkpointing
    assert config.performance.ddp_comm_hook == "bf16"


def test_null_for_a_required_value_from_yaml(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "c.yaml", {"batch_size": None})
    with pytest.raises(DistillError, match=r"batch_size: expected a value, got nothing; give it an integer"):
        load_config(["--config", str(path)])


def test_integer_valued_float_from_yaml_is_accepted(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "c.yaml", {"batch_size": 32.0})
    assert load_config(["--config", str(path)]).training.batch_size == 32
    path = write_yaml(tmp_path / "d.yaml", {"batch_size": 32.5})
    with pytest.raises(DistillError, match=r"batch_size: expected int, got 32\.5"):
        load_config(["--config", str(path)])


def test_yaml_values_of_the_wrong_kind_are_not_coerced(tmp_path: Path) -> None:
    """A YAML bool is no int, a list no path, a fraction no dimension, nan no weight: each says so."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "batch_size: true\nphase1_data: [a.txt, b.txt]\nstudent_model: {name: x}\nteacher_revision: yes\n"
        "use_projection: false\nmatryoshka_dims: [64.5, 32]\nkl_weight: .nan\nmax_grad_norm: .inf\n"
    )
    with pytest.raises(DistillError) as info:
        load_config(["--config", str(path)])
    message = str(info.value)
    for expected in (
        "batch_size: expected int, got True",
        "phase1_data: expected a single value, got a list: ['a.txt', 'b.txt']",
        "student_model: expected a single value, got a mapping",
        "teacher_revision: expected a text, got the YAML boolean True; quote it in the YAML file",
        "matryoshka_dims: expected a list of integers like 384,192, got [64.5, 32]",
        "kl_weight: expected a finite number, got nan",
        "max_grad_norm: expected a finite number, got inf",
    ):
        assert expected in message
    with pytest.raises(DistillError, match=r"phase1_lr: expected a finite number, got 'inf'"):
        load_config(["--phase1_lr", "inf"])


@pytest.mark.parametrize("spelling", ["no", "off", "'no'"])
def test_unquoted_mixed_precision_no_in_yaml_means_no(spelling: str, tmp_path: Path) -> None:
    """YAML 1.1 reads `mixed_precision: no` as false; it means the choice 'no', as in accelerate's own files."""
    path = tmp_path / "c.yaml"
    path.write_text(f"mixed_precision: {spelling}\n")
    assert load_config(["--config", str(path)]).performance.mixed_precision == "no"


def test_several_problems_reported_together(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "bad.yaml", {"batch_sise": 4, "phase2_epochs": 0})
    argv = ["--config", str(path), "--batch_size", "0", "--phase1_lr", "-1", "--mixed_precision", "fp32"]
    with pytest.raises(DistillError) as info:
        load_config(argv)
    message = str(info.value)
    assert "\n" not in message
    for expected in (
        "unknown config key 'batch_sise'; did you mean 'batch_size'",
        "batch_size: expected a number greater than 0",
        "phase1_lr: expected a number greater than 0",
        "phase2_epochs: expected a number greater than 0",
        "mixed_precision: expected one of no/fp16/bf16/auto, got 'fp32'",
    ):
        assert expected in message


def test_conversion_and_validation_problems_reported_together() -> None:
    with pytest.raises(DistillError) as info:
        load_config(["--seed", "abc", "--batch_size", "-3", "--skip_phase2", "perhaps"])
    message = str(info.value)
    assert "seed: expected int, got 'abc'" in message
    assert "batch_size: expected a number greater than 0, got -3" in message
    assert "skip_phase2: expected True or False, got 'perhaps'" in message


def test_bool_flag_alone_means_true() -> None:
    config = load_config(["--skip_phase1"])
    assert config.training.skip_phase1 is True
    assert config.training.skip_phase2 is False
    # a bare bool flag followed by another flag does not swallow it
    config = load_config(["--save_to_artifacts", "--batch_size", "4"])
    assert config.output.save_to_artifacts is True
    assert config.training.batch_size == 4


@pytest.mark.parametrize(
    ("value", "expected"),
    [("False", False), ("false", False), ("0", False), ("no", False), ("True", True), ("1", True), ("yes", True)],
)
def test_bool_flag_with_value(value: str, expected: bool) -> None:
    assert load_config(["--use_projection", value]).mode.use_projection is expected


def test_bool_from_yaml_overridden_by_flag(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "c.yaml", {"use_projection": False, "trust_remote_code": True})
    config = load_config(["--config", str(path), "--use_projection", "True"])
    assert config.mode.use_projection is True
    assert config.student.trust_remote_code is True


def test_matryoshka_dims_parsing(tmp_path: Path) -> None:
    mrl = ["--use_projection", "False", "--matryoshka_dims"]
    assert load_config([*mrl, "384,192"]).mode.matryoshka_dims == [384, 192]
    assert load_config([*mrl, "384"]).mode.matryoshka_dims == [384]
    assert load_config([*mrl, "64,32,"]).mode.matryoshka_dims == [64, 32]
    assert load_config([*mrl, "64", "32"]).mode.matryoshka_dims == [64, 32]  # space-separated, as `nargs="+"`
    assert load_config([*mrl, "64,", "32"]).mode.matryoshka_dims == [64, 32]
    assert load_config([*mrl, "None"]).mode.matryoshka_dims is None
    assert load_config(["--matryoshka_dims", "None"]).mode.matryoshka_dims is None  # projection mode: nothing set
    path = write_yaml(tmp_path / "c.yaml", {"use_projection": False, "matryoshka_dims": [256, 128, 64]})
    assert load_config(["--config", str(path)]).mode.matryoshka_dims == [256, 128, 64]


def test_optional_fields_accept_none() -> None:
    config = load_config(["--student_num_layers", "3", "--max_seq_length", "none", "--teacher_revision", "main"])
    assert config.student.student_num_layers == 3
    assert config.student.max_seq_length is None
    assert config.teacher.teacher_revision == "main"


def test_dump_config_round_trips(tmp_path: Path) -> None:
    original = load_config(
        [
            "--teacher_model",
            "/models/teacher",
            "--batch_size",
            "12",
            "--phase1_lr",
            "3e-4",
            "--phase2_epochs",
            "7",
            "--use_projection",
            "False",
            "--matryoshka_dims",
            "64,32",
            "--mixed_precision",
            "bf16",
            "--skip_phase1",
            "--student_num_layers",
            "2",
            "--teacher_query_prompt",
            "query: ",
            "--lr_scaling",
            "sqrt",
            "--num_processes",
            "2",
        ]
    )
    path = tmp_path / "config.yaml"
    dump_config(original, path)
    # the file is flat and flag-named
    dumped = yaml.safe_load(path.read_text())
    assert set(dumped) == set(config_module.FLAGS)
    assert dumped["phase1_lr"] == pytest.approx(3e-4)
    assert dumped["matryoshka_dims"] == [64, 32]
    reloaded = load_config(["--config", str(path)])
    assert reloaded == original
    assert to_flat_dict(reloaded) == to_flat_dict(original)


def test_dump_config_is_all_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails half-way (full disk) keeps the previous config.yaml whole and says so in one line."""
    path = tmp_path / "config.yaml"
    dump_config(load_config(["--batch_size", "12"]), path)
    before = path.read_text()
    write_text = Path.write_text

    def half_then_fail(self: Path, text: str, *args: object, **kwargs: object) -> int:
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    with pytest.raises(DistillError, match=r"cannot write .*config\.yaml \(No space left on device\); make the"):
        dump_config(load_config(["--batch_size", "16"]), path)
    monkeypatch.undo()
    assert path.read_text() == before
    assert load_config(["--config", str(path)]).training.batch_size == 12
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_default_config_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    dump_config(Config(), path)
    assert load_config(["--config", str(path)]) == Config()


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(DistillError, match=r"config file '.*nope\.yaml' does not exist"):
        load_config(["--config", str(missing)])


def test_invalid_yaml_and_non_mapping(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("batch_size: [1, 2\n")
    with pytest.raises(DistillError, match=r"is not valid YAML"):
        load_config(["--config", str(broken)])
    listing = tmp_path / "list.yaml"
    listing.write_text("- batch_size\n- 4\n")
    with pytest.raises(DistillError, match=r"must hold a mapping of flag names"):
        load_config(["--config", str(listing)])


def test_a_key_repeated_in_the_yaml_is_an_error_not_the_last_one_silently(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("phase1_lr: 1.0e-4\nbatch_size: 8\nseed: 1\nphase1_lr: 2.0e-5\nseed: 2\n")
    with pytest.raises(
        DistillError, match=r"c\.yaml' sets phase1_lr \(lines 1, 4\); seed \(lines 3, 5\) more than once; keep one"
    ):
        load_config(["--config", str(path)])


def test_empty_yaml_means_defaults(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(["--config", str(empty)]) == Config()


def test_shipped_demo_config_loads() -> None:
    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    config = load_config(["--config", str(demo)])
    assert config.mode.use_projection is False
    assert config.student.student_num_layers == 3
    # phase 1 on all the embedded general text (18,372 sentences), phase 2 on its pairs with their labels
    assert config.data.phase1_data == "embedded" and config.data.max_samples_phase1 > 18_372
    assert not config.training.skip_phase2 and not config.training.skip_phase1
    assert config.losses.mnrl_weight > 0


def test_help_lists_every_flag() -> None:
    text = build_parser().format_help()
    assert "--config" in text
    for flag in config_module.FLAGS:
        assert f"--{flag}" in text, flag
    flat = " ".join(text.split())  # argparse wraps the help texts
    assert "(default: all). (default:" not in flat  # a help that names its default is not given a second
    assert flat.count("default") >= len(config_module.FLAGS)  # the rest show theirs
    # values named by what they are, not by the flag's last word
    assert "--max_samples_phase1 N " in flat and "--mixed_precision no|fp16|bf16|auto " in flat and " WITH" not in flat


def test_every_leaf_field_has_a_flag_and_help() -> None:
    sections = [name for name in config_module.SECTIONS]
    assert sections == [f.name for f in dataclasses.fields(Config) if f.name != "dropped"]
    count = sum(len(dataclasses.fields(getattr(Config(), name))) for name in sections)
    assert len(config_module.FLAGS) == count  # flat names are unique across sections
    for leaf in config_module.LEAVES:
        assert leaf.help, leaf.flag
        assert "{" not in leaf.flag and "{" not in leaf.help
    assert {"phase1_lr", "phase2_lr", "phase1_epochs", "phase2_epochs"} <= set(config_module.FLAGS)


@pytest.mark.parametrize("flag", ["teacher_query_prompt", "teacher_document_prompt"])
def test_an_empty_prompt_means_no_prompt_not_the_teachers_own(flag: str, tmp_path: Path) -> None:
    assert getattr(load_config([f"--{flag}", ""]).teacher, flag) == ""
    assert getattr(load_config([]).teacher, flag) is None  # unset: the teacher's own
    path = tmp_path / "config.yaml"
    path.write_text(f'{flag}: ""\n')
    assert getattr(load_config(["--config", str(path)]).teacher, flag) == ""
    assert load_config(["--max_seq_length", ""]).student.max_seq_length is None  # other flags: "" is still unset


def test_help_is_grouped_by_topic_and_loads_no_model_library():
    """`--help` answers before torch, accelerate or sentence-transformers are imported, one section per topic."""
    import subprocess
    import sys

    from distill.config import HELP_GROUPS

    code = (
        "import sys\nfrom distill.train import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'accelerate', 'sentence_transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m distill.train [--config FILE] [--FLAG VALUE ...]\n")
    assert done.stdout.rstrip().endswith("[]")  # none of them
    headings = [line[:-1] for line in done.stdout.splitlines() if line and not line[0].isspace() and line[-1] == ":"]
    assert headings == ["options", *HELP_GROUPS.values()]
    assert "--temperature" in done.stdout.split("\nlosses:\n")[1].split("\nperformance:\n")[0]


def test_the_usage_line_names_the_console_script(monkeypatch):
    import sys

    from distill.config import build_parser

    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/distill-train"])
    assert build_parser().format_usage().startswith("usage: distill-train [--config FILE]")
    monkeypatch.setattr(sys, "argv", ["/repo/distill/train.py"])  # python -m distill.train, accelerate launch
    assert build_parser().format_usage().startswith("usage: python -m distill.train [--config FILE]")


def test_a_config_files_setting_that_a_flag_makes_irrelevant_is_dropped_with_a_warning(tmp_path):
    """`--config configs/demo_mpnet.yaml --skip_phase2` runs: the file's phase1_teacher_model no longer applies."""
    from distill.config import load_config

    demo_mpnet = str(Path(__file__).resolve().parents[1] / "configs" / "demo_mpnet.yaml")
    config = load_config(["--config", demo_mpnet, "--skip_phase2"])
    assert config.teacher.phase1_teacher_model is None and config.training.skip_phase2
    assert config.dropped == (
        "phase1_teacher_model from --config is ignored: sets phase 1's target and leaves the teacher to phase 2, "
        "so it needs both phases",
    )
    # typed on the command line, it is a contradiction; written in the file next to its own skip_phase2, too
    with pytest.raises(DistillError, match="phase1_teacher_model: sets phase 1's target .* needs both phases"):
        load_config(["--config", demo_mpnet, "--skip_phase2", "--phase1_teacher_model", "m"])
    own = tmp_path / "own.yaml"
    own.write_text("phase1_teacher_model: m\nuse_projection: false\nskip_phase2: true\n")
    with pytest.raises(DistillError, match="phase1_teacher_model: sets phase 1's target"):
        load_config(["--config", str(own)])


# What the kinds of teacher beyond one local model (an endpoint, a vectors file, several combined, a reranker) and of
# student beyond the transformer (a static table), and phase 1's token budget for GPUs, add to the lean core's options.
KIND_OPTIONS = {
    "--reranker_model",
    "--reranker_base_url",
    "--reranker_api_key_env",
    "--reranker_loss",
    "--reranker_weight",
    "--reranker_temperature",
    "--max_tokens_per_batch",
    "--teacher_base_url",
    "--teacher_api_key_env",
    "--teacher_dimensions",
    "--teacher_vectors",
    "--teacher_weights",
    "--student_dim",
    "--student_tokenizer",
}


def test_help_lists_at_most_68_core_options_grouped_by_the_config_trees_sections() -> None:
    text = build_parser().format_help()
    options = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert KIND_OPTIONS <= set(options)
    # 65, phase 2's label loss (its weight and its false-negative margin; its scale is 1/--temperature) and the
    # exported ONNX forms
    assert len(options) - len(KIND_OPTIONS) <= 68, len(options)
    assert list(config_module.HELP_GROUPS) == list(config_module.SECTIONS)


@pytest.mark.parametrize(
    "name", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
)
def test_every_shipped_config_loads(name):
    config = load_config(["--config", str(Path(__file__).resolve().parents[1] / "configs" / name)])
    assert not config.dropped  # nothing in a shipped file contradicts another of its keys
