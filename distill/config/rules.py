"""What a valid config is: each field's own checks, the options that apply only to a kind or a mode, and the
settings that contradict each other. Every problem is one fix-it line; `validate` returns them all.

An option that applies only somewhere is one rule in one form, "<flag>: applies only to <what>; <how> or drop
--<flag>". Where it applies comes from the field's `scope` (a mode: distill/config/schema.py) or from the kinds
(distill/students, distill/teachers): an option some kind owns applies only to that kind, and a kind may turn
down one of its own for a name (a table read from a folder keeps its width).
"""

from __future__ import annotations

import typing
from pathlib import Path

from distill.config.constraints import Scope
from distill.config.flags import FLAGS, LEAVES
from distill.config.schema import Config


class Contradiction(typing.NamedTuple):
    """Two settings that cannot go together: `key` stops applying when one of `others` is set as it is."""

    key: str
    others: tuple[str, ...]
    applies: bool
    message: str


def validate(config: Config) -> list[str]:
    """Every problem with an otherwise well-typed config, as fix-it messages: each field's own constraints (its
    choices and its `Check`), then the settings that contradict each other."""
    problems = []
    for leaf in LEAVES:
        value = leaf.value(config)
        if leaf.choices and value is not None and value not in leaf.choices:
            problems.append(f"{leaf.flag}: expected one of {'/'.join(leaf.choices)}, got {value!r}")
        problem = leaf.check.problem(leaf.flag, value) if leaf.check else None
        if problem:
            problems.append(problem)
    return problems + [c.message for c in contradictions(config) if c.applies]


def contradictions(config: Config) -> list[Contradiction]:
    """Each pair of settings that cannot go together, whether it applies to `config`, and its message."""
    return [*_out_of_scope(config), *_kinds_out_of_scope(config), *_own(config)]


def _is_set(config: Config, flag: str) -> bool:
    leaf = FLAGS[flag]
    return bool(leaf.value(config) != leaf.value(DEFAULTS))


def _rule(config: Config, flag: str, scope: Scope, applies: bool) -> Contradiction:
    """The one form of "this option applies only to <scope>"."""
    message = f"{flag}: applies only to {scope.what}; {scope.how} or drop --{flag}"
    return Contradiction(flag, scope.deciders, applies and _is_set(config, flag), message)


def _out_of_scope(config: Config) -> list[Contradiction]:
    """Options whose field names a scope (a mode), set outside it."""
    return [_rule(config, leaf.flag, leaf.scope, not leaf.scope.applies(config)) for leaf in LEAVES if leaf.scope]


def _kinds_out_of_scope(config: Config) -> list[Contradiction]:
    """Options a kind of student or teacher owns, set for another kind, or turned down by the kind chosen."""
    from distill.students import KINDS as STUDENT_KINDS
    from distill.students import student_kind
    from distill.teachers import KINDS as TEACHER_KINDS
    from distill.teachers import teacher_kind, teacher_names

    student = student_kind(config.student.student_model)
    teachers = [teacher_kind(name) for name in teacher_names(config.teacher)]
    rows = {}
    for kinds, chosen, decider in (
        (STUDENT_KINDS, [student], "student_model"),
        (TEACHER_KINDS, teachers, "teacher_model"),
    ):
        for owner in kinds:
            for flag in owner.options:
                if flag not in rows and not any(flag in kind.options for kind in chosen):
                    rows[flag] = _rule(config, flag, Scope(owner.scope, owner.how, (decider,)), True)
    for flag, scope in student.refuses(config.student).items():
        rows[flag] = _rule(config, flag, scope, True)
    return list(rows.values())


def _own(config: Config) -> list[Contradiction]:
    """The settings that contradict each other otherwise."""
    data, training, checkpoint, teacher = config.data, config.training, config.checkpoint, config.teacher
    accelerate_config = config.launch.accelerate_config
    # without periodic evaluations each phase has one candidate, the model exported anyway: nothing to keep
    keep_best_why = "eval_data is none" if data.eval_data == "none" else "eval_steps is 0 (only phase ends)"
    keep_best_fix = "--eval_steps N and an --eval_data" if data.eval_data == "none" else "--eval_steps N"
    names = [n for n in (teacher.teacher_model or "").split(",") if n.strip()]
    weights = len(teacher.teacher_weights.split(",")) if teacher.teacher_weights else len(names)
    return [
        Contradiction(
            "teacher_weights",
            ("teacher_model",),
            weights != len(names),
            f"teacher_weights: gives {weights} weights for {len(names)} teachers; give one weight per teacher of "
            "--teacher_model A,B (comma-separated), or drop --teacher_weights",
        ),
        Contradiction(
            "keep_best",
            ("eval_data", "eval_steps"),
            checkpoint.keep_best and (data.eval_data == "none" or checkpoint.eval_steps == 0),
            f"keep_best: keeps the best of the evaluations every --eval_steps steps, but {keep_best_why}; pass "
            f"{keep_best_fix} or drop --keep_best",
        ),
        Contradiction(
            "accelerate_config",
            (),
            accelerate_config is not None and not Path(accelerate_config).expanduser().is_file(),
            f"accelerate_config: {accelerate_config!r} does not exist; pass one of accelerate_configs/*.yaml "
            "or a file written by `accelerate config`",
        ),
        Contradiction(
            "phase1_teacher_model",
            ("skip_phase1", "skip_phase2"),
            teacher.phase1_teacher_model is not None and (training.skip_phase1 or training.skip_phase2),
            "phase1_teacher_model: sets phase 1's target and leaves the teacher to phase 2, so it needs both phases; "
            "drop --phase1_teacher_model or --skip_phase1 / --skip_phase2",
        ),
        Contradiction(
            "reranker_model",
            ("skip_phase2",),
            config.reranker.reranker_model is not None and training.skip_phase2,
            "reranker_model: scores phase 2's candidates, but --skip_phase2 skips phase 2; pass --skip_phase2 False "
            "or drop --reranker_model",
        ),
        Contradiction(
            "skip_phase1",
            (),
            training.skip_phase1 and training.skip_phase2,
            "skip_phase1 and skip_phase2 are both set: nothing would be trained; drop one of them",
        ),
    ]


def drop_inherited(config: Config, inherited: set[str], typed: set[str]) -> list[str]:
    """Settings from the --config file that a flag on the command line made irrelevant, reset to their defaults.

    A key the file sets stops applying when a flag changes what it applies to (the file's --keep_best under a typed
    --eval_data none): it is dropped, not an error. Only what the user typed can contradict. Returns a
    warning line for each key dropped.
    """
    warnings = []
    for contradiction in contradictions(config):
        key = contradiction.key
        if contradiction.applies and key in inherited and any(other in typed for other in contradiction.others):
            leaf = FLAGS[key]
            setattr(getattr(config, leaf.section), leaf.name, leaf.value(DEFAULTS))
            reason = contradiction.message.split("; ")[0].removeprefix(f"{key}: ")
            warnings.append(f"{key} from --config is ignored: {reason}")
    return warnings


DEFAULTS = Config()
