"""The runs of `prescient bench`: the baselines, the built-in predictors, a run's spec, the grids
of runs, and the checks that fail on a bad grid before any work."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from predictor.registry import FITTED, canonical_name
from prescient.budget import Budget
from prescient.errors import PrescientError

SERVABLE = ("freq", "token", "corr", "oracle")  # built-ins a run can serve with (lookahead runs the model twice)
BASELINES = ("all_resident", "accelerate_disk")


class BenchError(PrescientError):
    """A benchmark was asked for with missing or malformed inputs."""


PREFETCH_MODES = ("hide", "next")  # hide-only prefetch (needs a link timing), cross-token prefetch
# the runtime's schedulers, switched per run: in-token lookahead on (`look`, HybriMoE), the expert
# pipeline off (`serial`: a layer waits for all its copies, the runtime before the compute-while-loading order),
# HybriMoE's scheduler on (`hybrid`: `RuntimeOptions.hybrid_schedule`; admission on a CPU-only host)
SCHEDULER_MODES = ("look", "serial", "hybrid")
RUN_MODES = PREFETCH_MODES + SCHEDULER_MODES


@dataclass(frozen=True)
class RunSpec:
    predictor: str  # "none", a built-in name, or the NAME of a NAME=PATH artifact
    policy: str
    budget: float
    modes: tuple[str, ...] = ()  # of RUN_MODES, in that order

    @property
    def label(self) -> str:
        return f"{self.predictor}+{self.policy}@{self.budget:g}" + "".join(f"+{mode}" for mode in self.modes)


def default_grid(budgets: list[float], predictors: list[str], policies: list[str]) -> list[RunSpec]:
    """Per budget: none+lru; every predictor with mrs and lru; sida (if given) with every policy."""
    runs = []
    for budget in budgets:
        runs += [RunSpec("none", "lru", budget)] if "none" in predictors else []
        for name in (p for p in predictors if p != "none"):
            chosen = ("mrs", "lru", *policies) if name == "sida" else ("mrs", "lru")
            runs += [RunSpec(name, policy, budget) for policy in dict.fromkeys(chosen)]
    return runs


def full_grid(budgets: list[float], predictors: list[str], policies: list[str]) -> list[RunSpec]:
    return [RunSpec(p, policy, b) for b in budgets for p in predictors for policy in policies]


def parse_runs(text: str) -> list[RunSpec]:
    """`none:lru@0.5,sida:mrs@0.25+hide+next` -> run specs (budgets are fractions of all experts;
    `+hide`, `+next`: the prefetch modes of `PREFETCH_MODES`, which need a predictor; `+look`,
    `+serial`, `+hybrid`: the scheduler modes of `SCHEDULER_MODES`)."""
    runs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        head, _, tail = item.partition("@")
        predictor, _, policy = head.partition(":")
        budget, *modes = tail.split("+")
        try:
            if not (predictor and policy and budget):
                raise ValueError("a part is missing")
            unknown = [m for m in modes if m not in RUN_MODES]
            if unknown or len(set(modes)) < len(modes):
                raise ValueError(f"run modes are +{' +'.join(RUN_MODES)}, each once; got {modes}")
            if set(modes) & set(PREFETCH_MODES) and canonical_name(predictor) == "none":
                raise ValueError("prefetch modes need a predictor")
            runs.append(RunSpec(canonical_name(predictor), policy, fraction(Budget.parse(budget)),
                                tuple(m for m in RUN_MODES if m in modes)))
        except (ValueError, BenchError) as exc:  # CapacityError is a ValueError
            raise BenchError(f"--runs entry {item!r} is not PREDICTOR:POLICY@BUDGET"
                             f"[+hide][+next][+look][+serial][+hybrid] (e.g. sida:mrs@0.5): {exc}") from None
    return runs


def fraction(budget: Budget) -> float:
    """A budget the runtime benchmark can plot: a fraction of all experts."""
    if budget.unit != "fraction":
        raise BenchError(f"budget {budget} is not a fraction of all experts; the benchmark compares fractions "
                         "(0.25, 50%)")
    return budget.amount


def check_grid(runs: list[RunSpec], predictors: dict[str, str | None], train_trace: str | Path | None) -> None:
    """Fail before any work on an unknown predictor, policy or budget, or a fit without a trace."""
    from cache import CacheError, make_serving_policy

    for name, path in predictors.items():
        if path is None and name != "none" and name not in SERVABLE:
            raise BenchError(f"unknown predictor {name!r}; use none, {', '.join(SERVABLE)} or NAME=PATH (an artifact)")
        if path is None and name in FITTED and train_trace is None:
            raise BenchError(f"predictor {name!r} is fit on a trace: pass --train-trace DIR (make one with "
                             "`prescient trace --model DIR --dataset stdlib-code --split train --out DIR`)")
    for spec in runs:
        if spec.predictor not in predictors:
            raise BenchError(f"run {spec.label} uses predictor {spec.predictor!r}, which --predictors does not name")
        try:
            make_serving_policy(spec.policy, top_k=1)
        except CacheError as exc:
            raise BenchError(f"run {spec.label}: unknown policy or one that cannot serve: {exc}") from None
