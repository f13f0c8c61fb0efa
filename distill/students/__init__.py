"""Students: what the phases train and sentence-transformers loads, one module per kind behind one interface.

- transformer.py: a SentenceTransformer built on a transformer, cut to some of its layers;
- static.py: a table of token vectors, averaged, for CPUs, phones and browsers;
- base.py: the interface every kind answers (`StudentKind`) and the registry;
- head.py: what every student shares (the model Accelerate prepares, the projection, the Matryoshka basis);
- attention.py: faster attention for transformer students.

The phases never ask which kind they train. The run, the config checks, the planner, the cost stage, export and
the card ask the kind (`student_kind(name)`, `kind_of(model)`). A new kind is one module and one
`register_student_kind` call.
"""

from __future__ import annotations

from distill.students.kinds import KINDS, StudentKind, kind_of, register_student_kind, student_kind
from distill.students.static import STATIC
from distill.students.transformer import TRANSFORMER

__all__ = ["KINDS", "StudentKind", "kind_of", "register_student_kind", "student_kind"]

# the transformer claims every name, so it is asked last: registered first
register_student_kind(TRANSFORMER)
register_student_kind(STATIC)
