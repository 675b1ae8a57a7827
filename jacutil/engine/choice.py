"""Which path a call took, and why: what ``explain=True`` returns.

:class:`Choice` is said the same way by ``jacutil.jacobian``, the per-sample
loss gradients and every entry that runs on the engine (:func:`choice_for`).
"""

import time
from dataclasses import dataclass, field

# what a compiled Jacobian spends its time on (CompiledJacobian.spent)
SPENT = (
    "checking the rules", "counting activations", "tracing and compiling",
    "running eagerly (a first call: no trace)", "running",
)
EAGER = SPENT[3]  # fmt: skip


@dataclass
class Choice:
    """Which path ``jacobian`` took, and why. ``print(choice)`` says it in words.

    ``formulation``: how the Jacobian was computed (the compiled stage's);
    ``chunks`` of ``chunk_size`` samples (1 and None: one call);
    ``working_bytes``: the working memory predicted for the call, held to
    ``budget_bytes``.
    """

    path: str  # "layer rules" or "per-sample autodiff"
    why: str
    formulation: str
    layers: list = field(default_factory=list)  # [(layer name, rule)], rules path
    chunks: int = 1
    chunk_size: int | None = None
    working_bytes: int = 0
    budget_bytes: int = 0
    traced: bool = False  # this call traced (compiled) a new function
    spent: dict = field(default_factory=dict)  # seconds of this call, by what
    check: str = ""  # how the rules were proved, where this call proved them

    def __str__(self):
        lines = [f"path: {self.path} ({self.why})"]
        if self.layers:
            lines += [f"  layer {name}: {rule}" for name, rule in self.layers]
        else:
            lines.append(f"how: {self.formulation}")
        memory = (
            f"working memory about {self.working_bytes / 2**20:,.0f} MiB, "
            f"budget {self.budget_bytes / 2**20:,.0f} MiB"
        )
        if self.chunks > 1:
            lines.append(
                f"chunks: {self.chunks} of {self.chunk_size} samples ({memory})"
            )
        else:
            lines.append(f"one call, no chunks ({memory})")
        if self.spent.get(EAGER):
            lines.append("ran eagerly: a first call on such inputs (the next traces)")
        else:
            lines.append(
                "traced in this call" if self.traced else "compiled function reused"
            )
        if self.check:
            lines.append(self.check)
        if self.spent:
            total = self.spent.get("total", 0.0)
            parts = {what: s for what, s in self.spent.items() if what != "total"}
            rest = max(0.0, total - sum(parts.values()))
            words = [f"{what} {seconds:.2f} s" for what, seconds in parts.items()]
            words.append(f"reading the data and planning {rest:.2f} s")
            lines.append(f"this call took {total:.2f} s: {', '.join(words)}")
        return "\n".join(lines)


RULES_WHY = "every layer has a rule or passes its signal by autodiff"


def spent_since(jac, before, start):
    """The seconds ``jac`` (a ``CompiledJacobian``) spent since its
    ``spent`` was ``before`` (a copy), by what (:data:`SPENT`), and the
    ``total`` since ``start`` (a ``time.perf_counter()`` reading): what
    ``explain=True`` says a call spent."""
    spent = {
        what: jac.spent[what] - before.get(what, 0.0)
        for what in SPENT
        if jac.spent[what] - before.get(what, 0.0) > 0
    }
    return spent | {"total": time.perf_counter() - start}


def choice_for(jac, plan, on_rules, formulation, traced, fallback=None, spent=None):
    """The :class:`Choice` of a call on ``jac``'s layer rules or its fallback
    (``jacobian`` and the per-sample loss gradients say it the same way),
    for the call's :class:`jacutil.core.planner.Plan`; ``fallback`` says why
    not the layer rules (default ``jac.fallback``)."""
    why = RULES_WHY if on_rules else f"no layer rules: {fallback or jac.fallback}"
    return Choice(
        path="layer rules" if on_rules else "per-sample autodiff",
        why=why,
        formulation=formulation,
        layers=jac.plan.layers() if on_rules else [],
        chunks=plan.n_chunks,
        chunk_size=plan.chunk_size,
        working_bytes=plan.working,
        budget_bytes=plan.budget,
        traced=traced,
        spent=spent or {},
        check=str(jac.plan.report)
        if on_rules and (spent or {}).get("checking the rules")
        else "",
    )
