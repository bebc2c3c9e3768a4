"""Run one model on every backend and compare: forward, loss, gradients, optimizer steps, and a
model saved on each backend loaded on the others.

``compare_model(pool, source, x, y)`` returns a ``Report``: one row per output, gradient and
weight after each optimizer step, with max absolute / relative differences and pass/fail against
``kbackend.equivalence.tolerances.TOLERANCES``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.equivalence.pool import EquivalenceError, WorkerFailed, WorkerPool
from kbackend.equivalence.tolerances import TOLERANCES, divergence_for_error
from kbackend.model_sources import ModelSource
from kbackend.optim import OptimizerSpec

# Optimizers the step comparisons run by default: kbackend OptimizerSpec fields plus a label.
DEFAULT_OPTIMIZERS: tuple[dict[str, Any], ...] = (
    {"label": "sgd", "name": "sgd", "learning_rate": 0.01},
    {"label": "momentum", "name": "momentum", "learning_rate": 0.01, "momentum": 0.9},
    {"label": "adam", "name": "adam", "learning_rate": 0.001},
)
DEFAULT_STEPS = 3
# Optimizers whose update is not linear in the gradient (see tf-sparse-adam-duplicate-ids).
NONLINEAR_OPTIMIZERS = ("adam", "adamw")


@dataclass
class Row:
    """One compared quantity (an output, a gradient, a weight after a step...)."""

    quantity: str  # a key of TOLERANCES
    name: str
    max_abs: float
    max_rel: float
    passed: bool
    note: str = ""
    # The known divergence (a key of KNOWN_DIVERGENCES) that explains a failure, if any.
    known: str = ""
    optimizer: str = ""
    weight: str = ""

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


@dataclass
class Report:
    """Every row of one comparison between a reference backend and the others."""

    reference: str
    others: tuple[str, ...]
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.passed]

    @property
    def unexplained(self) -> list[Row]:
        """Failures that no known divergence explains (what a property test rejects)."""
        return [r for r in self.failures if not r.known]

    def known_divergences(self) -> list[str]:
        return sorted({r.known for r in self.failures if r.known})

    def table(self, only_failures: bool = False) -> str:
        """A plain-text table: quantity, name, max abs, max rel, tolerance, pass/fail."""
        header = (f"{'quantity':<12} {'name':<52} {'max abs':>10} {'max rel':>10} {'rtol':>8}  "
                  "result")
        lines = [header, "-" * len(header)]
        for row in self.rows:
            if only_failures and row.passed:
                continue
            tol = TOLERANCES[row.quantity]
            lines.append(f"{row.quantity:<12} {row.name[:52]:<52} {row.max_abs:>10.3g} "
                         f"{row.max_rel:>10.3g} {tol.rtol:>8.0e}  "
                         f"{'pass' if row.passed else 'FAIL'}"
                         + (f"  (known divergence: {row.known})" if row.known else "")
                         + (f"  ({row.note})" if row.note else ""))
        return "\n".join(lines)

    def summary(self) -> str:
        verdict = "all pass" if self.passed else f"{len(self.failures)} of {len(self.rows)} FAIL"
        if self.known_divergences():
            verdict += f" (known divergences: {', '.join(self.known_divergences())})"
        return (f"{self.reference} vs {', '.join(self.others)}: {len(self.rows)} comparisons, "
                f"{verdict}")

    def to_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "others": list(self.others), "passed": self.passed,
                "rows": [r.to_dict() for r in self.rows], "notes": self.notes}


def difference(a: Any, b: Any) -> tuple[float, float]:
    """Max absolute difference and the same divided by the larger of the two tensors' max |x|.

    Matching NaNs and matching infinities count as equal; any other non-finite mismatch gives inf.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return math.inf, math.inf
    if a.size == 0:
        return 0.0, 0.0
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: handled by ``same``
        diff = np.where(same, 0.0, np.abs(a - b))
    diff = np.where(np.isnan(diff), np.inf, diff)
    max_abs = float(diff.max())
    finite = np.concatenate([np.abs(a[np.isfinite(a)]), np.abs(b[np.isfinite(b)])])
    scale = float(finite.max()) if finite.size else 0.0
    if max_abs == 0.0:
        return 0.0, 0.0
    return max_abs, (max_abs / scale if scale > 0 else math.inf)


def within(quantity: str, max_abs: float, max_rel: float) -> bool:
    """Whether a difference passes the tolerance of ``quantity``."""
    tol = TOLERANCES[quantity]
    return max_abs <= tol.atol or max_rel <= tol.rtol


def compare_arrays(quantity: str, name: str, a: Any, b: Any, note: str = "") -> Row:
    """One report row for arrays ``a`` (reference) and ``b``."""
    a_arr, b_arr = np.asarray(a), np.asarray(b)
    if a_arr.shape != b_arr.shape:
        return Row(quantity, name, math.inf, math.inf, False,
                   f"shapes differ: {a_arr.shape} vs {b_arr.shape}")
    max_abs, max_rel = difference(a_arr, b_arr)
    return Row(quantity, name, max_abs, max_rel, within(quantity, max_abs, max_rel), note)


def adam_step1_bound(spec: dict[str, Any], grad_a: Any, grad_b: Any) -> np.ndarray | None:
    """How far one Adam/AdamW step moves two copies of a weight apart, given their gradients.

    Keras's first Adam step is ``w -= lr * g / (|g| + eps_hat)`` with ``eps_hat = epsilon /
    sqrt(1 - beta2)`` (m and v start at zero; AdamW's decoupled decay is the same on both
    sides). Its slope ``lr * eps_hat / (|g| + eps_hat)^2`` is up to ``lr / eps_hat`` (3e2 at
    the defaults) where |g| << eps_hat ~ 3e-6: there the float32 round-off in which two
    backends' gradients differ is amplified far beyond the weights' own rounding. This is that
    map applied to the two measured gradients, element by element; None for other optimizers or
    a schedule (the rate at step 1 is then not the spec's).
    """
    if (spec.get("name") not in NONLINEAR_OPTIMIZERS
            or spec.get("schedule", "constant") != "constant"
            or spec.get("warmup_steps", 0)):
        return None
    defaults = OptimizerSpec()
    epsilon = spec.get("epsilon", defaults.epsilon)
    eps_hat = epsilon / math.sqrt(1.0 - spec.get("beta2", defaults.beta2))
    a, b = np.asarray(grad_a, dtype=np.float64), np.asarray(grad_b, dtype=np.float64)
    rate = spec.get("learning_rate", defaults.learning_rate)
    return rate * np.abs(a / (np.abs(a) + eps_hat) - b / (np.abs(b) + eps_hat))


def compare_adam_step1(name: str, a: Any, b: Any, bound: np.ndarray) -> Row:
    """A step-1 row of Adam/AdamW: the weights' difference beyond ``adam_step1_bound`` (what the
    gradients' measured difference explains) must meet the ``step1`` tolerance."""
    row = compare_arrays("step1", name, a, b)
    if row.passed or not math.isfinite(row.max_abs) or np.shape(a) != bound.shape:
        return row
    diff = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
    unexplained = np.maximum(diff - bound, 0.0)
    scale = max(float(np.abs(np.asarray(a, dtype=np.float64)).max()),
                float(np.abs(np.asarray(b, dtype=np.float64)).max()))
    residual = float(unexplained.max())
    if within("step1", residual, residual / scale if scale > 0 else math.inf):
        row.passed = True
        row.note = (f"within Adam's step-1 amplification of the gradients' difference (up to "
                    f"{float(bound.max()):.2g}; unexplained {residual:.2g})")
    return row


def compare_results(reference: dict[str, Any], other: dict[str, Any], output_names: list[str],
                    label: str = "", optimizers: tuple[dict[str, Any], ...] = ()) -> list[Row]:
    """Rows comparing two ``operations.evaluate`` results (reference first)."""
    rows = []
    suffix = f" [{label}]" if label else ""
    for name, a, b in zip(output_names, reference["outputs"], other["outputs"], strict=True):
        rows.append(compare_arrays("forward", f"output {name}{suffix}", a, b))
    if "loss" not in reference:
        return rows
    rows.append(compare_arrays("loss", f"loss{suffix}", reference["loss"], other["loss"]))
    for name, a, b in zip(reference["trainable_names"], reference["gradients"], other["gradients"],
                          strict=True):
        row = compare_arrays("gradient", f"d loss / d {name}{suffix}", a, b)
        row.weight = name
        rows.append(row)
    specs = {spec.get("label", spec.get("name")): spec for spec in optimizers}
    gradients = dict(zip(reference["trainable_names"],
                         zip(reference["gradients"], other["gradients"], strict=True), strict=True))
    for label_opt, ref_steps in reference["steps"].items():
        other_steps = other["steps"][label_opt]
        for step, ref_params in sorted(ref_steps["params"].items()):
            quantity = "step1" if step == 1 else "stepK"
            for name, a, b in zip(reference["weight_names"], ref_params,
                                  other_steps["params"][step], strict=True):
                row_name = f"{label_opt} step {step}: {name}{suffix}"
                bound = (adam_step1_bound(specs[label_opt], *gradients[name])
                         if step == 1 and label_opt in specs and name in gradients else None)
                row = (compare_arrays(quantity, row_name, a, b) if bound is None
                       else compare_adam_step1(row_name, a, b, bound))
                row.optimizer, row.weight = label_opt, name
                rows.append(row)
    return rows


@dataclass
class Case:
    """Everything that defines one comparison: model source, weights, data, loss, optimizers.

    ``loss`` None (the default) is the loss the model was compiled with (a ``.keras`` file's,
    a builder's), else ``"mse"``; the report notes which it used.
    """

    source: dict[str, Any]
    x: list[np.ndarray]
    y: list[np.ndarray] | None
    loss: Any = None
    weights: list[np.ndarray] | None = None
    optimizers: tuple[dict[str, Any], ...] = DEFAULT_OPTIMIZERS
    steps: int = DEFAULT_STEPS
    check_saved: bool = True


def safe_mode(source: dict[str, Any]) -> bool:
    """Whether files of ``source``'s model load in Keras's safe mode: not for a ``.keras`` file
    loaded with ``unsafe_deserialization``, nor for a builder (its code runs anyway, and its
    ``Lambda`` layers are the user's own)."""
    return not (source.get("unsafe_deserialization") or source["kind"] == "builder")


def absolute_source(source: dict[str, Any]) -> dict[str, Any]:
    """``source`` with its file paths made absolute here (``ModelSource.to_json``): workers may
    have started in another working directory (a pool lives across ``chdir``s)."""
    if source.get("kind") in ("arch", "config"):
        return source
    return {**source, **ModelSource.from_json(source).to_json()}


class CaseError(EquivalenceError):
    """A case no backend can run (a loss that does not fit the model's output, targets of the
    wrong shape): bad input, not a difference between backends."""


def loss_words(loss: Any) -> str:
    """A loss identifier as a person names it: ``mse``, ``SparseCategoricalCrossentropy
    (from_logits)``."""
    if not isinstance(loss, dict):
        return str(loss)
    config = loss.get("config") or {}
    name = str(loss.get("class_name") or config.get("name") or loss)
    return name + (" (from_logits)" if config.get("from_logits") else "")


def compare_model(pool: WorkerPool, case: Case, reference: str | None = None,
                  save_dir: str | Path | None = None,
                  planted_weights: dict[str, list[np.ndarray]] | None = None) -> Report:
    """Run ``case`` on every backend of ``pool`` and compare each against ``reference``.

    Weights come from ``case.weights`` or, if None, from the model as the reference worker
    builds or loads it; either way every backend gets the same arrays. ``planted_weights``
    (backend -> weights) gives a backend different weights on purpose: the harness's self-test
    that a planted difference is found and named.
    """
    backends = pool.backends
    reference = reference or backends[0]
    others = tuple(b for b in backends if b != reference)
    report = Report(reference, others)
    case = replace(case, source=absolute_source(case.source))
    description = pool.call(reference, "describe", source=case.source)
    weights = case.weights if case.weights is not None else description["weights"]
    loss = case.loss
    if loss is None and case.y is not None:
        loss = description.get("loss") or "mse"
        report.notes.append(f"loss: {loss_words(loss)}, " + (
            "the model's compiled loss" if description.get("loss") else
            "the default (the model was not compiled with a loss; pass one to compare another)"))
    output_names = [o["name"] for o in description["outputs"]]
    save_dir = Path(save_dir or pool.work_dir)
    saved = {b: str(save_dir / f"model-saved-on-{b}.keras") for b in backends}
    args = {b: {"source": case.source, "weights": weights, "x": case.x, "y": case.y,
                "loss": loss, "optimizers": list(case.optimizers), "steps": case.steps,
                "save_path": saved[b] if case.check_saved else None} for b in backends}
    for backend, planted in (planted_weights or {}).items():
        args[backend]["weights"] = planted
    try:
        results = pool.call_each(args, "evaluate")
    except WorkerFailed as error:
        report.rows.append(_failure_row(error, backends, loss))
        return report
    inert = results[reference].get("inert") or []
    if inert:
        report.notes.append("stochastic layers made inert for loss/gradients/steps (compared in "
                            f"inference mode): {', '.join(inert)}")
    for other in others:
        report.rows.extend(compare_results(results[reference], results[other], output_names,
                                           "" if len(others) == 1 else other,
                                           tuple(case.optimizers)))
    _attribute_sparse_adam(report.rows, case, results)
    _attribute_adam_roundoff(report.rows, case)
    _attribute_batchnorm_cancellation(report, results)
    _attribute_unstable_training(report.rows, results[reference])
    if case.check_saved:
        report.rows.extend(_compare_saved(pool, case, weights, saved, results, output_names))
    _attribute_misrouted_adds(report, results)
    return report


def _failure_row(error: WorkerFailed, backends: tuple[str, ...], loss: Any) -> Row:
    """The row of a backend the case does not run on (a known divergence named where one
    matches); a ``CaseError`` when it runs on none: then the case, not a backend, is wrong."""
    if set(error.failed_backends) >= set(backends) and len(backends) > 1:
        raise CaseError(
            f"The case runs on no backend ({', '.join(backends)}), so the model, its inputs, "
            f"targets and loss ({loss_words(loss)}) do not fit together: not a difference "
            f"between backends. {error.backend}: {' '.join(error.error.split())[:400]}"
        ) from None
    divergence = divergence_for_error(error.error)
    note = (f"known divergence {divergence.name!r}: {divergence.what}" if divergence
            else "the model does not run on this backend")
    return Row("forward", f"run on {error.backend}", math.inf, math.inf, False,
               f"{note} [{error.error}]", known=divergence.name if divergence else "")


def _attribute_misrouted_adds(report: Report, results: dict[str, Any]) -> None:
    """Mark every failure of a model in which Keras' TF ``add`` put a bias on the wrong axis.

    The wrong numbers start in the forward pass, so every quantity downstream of it differs;
    the rule applies only when the TF worker actually observed such an add in this model.
    """
    misrouted = {b: r.get("misrouted_adds") for b, r in results.items() if r.get("misrouted_adds")}
    if not misrouted:
        return
    report.notes.extend(f"{backend}: additions with the bias on the wrong axis: {', '.join(adds)}"
                        for backend, adds in misrouted.items())
    for row in report.failures:
        if not row.known:
            row.known = "keras-tf-add-bias-heuristic"


def _attribute_sparse_adam(rows: list[Row], case: Case, results: dict[str, Any]) -> None:
    """Mark the step failures explained by ``tf-sparse-adam-duplicate-ids``.

    It applies only when a backend produced a sparse gradient (an Embedding on TF), an integer
    input repeats an id within the batch, and the optimizer's update is not linear in the
    gradient (Adam): after one step only the sparse weights can differ; after K steps every
    weight of that optimizer's run can (the difference propagates through the forward pass).
    """
    sparse = {n for r in results.values() for n in r.get("sparse_gradients", [])}
    repeated = any(np.issubdtype(np.asarray(a).dtype, np.integer)
                   and np.unique(a).size < np.asarray(a).size for a in case.x)
    if not (sparse and repeated):
        return
    nonlinear = {o.get("label", o["name"]) for o in case.optimizers
                 if o["name"] in NONLINEAR_OPTIMIZERS}
    for row in rows:
        if row.passed or row.optimizer not in nonlinear:
            continue
        if row.quantity == "stepK" or (row.quantity == "step1" and row.weight in sparse):
            row.known = "tf-sparse-adam-duplicate-ids"


# Below this relative spread (std / max|x|) of a BatchNormalization input, one ulp of round-off
# in the input exceeds 1e-5 of the normalized output: float32 epsilon 1.2e-7 / 1e-2 ~ 1e-5.
BATCHNORM_SPREAD_LIMIT = 1e-2
TRAINING_QUANTITIES = ("loss", "gradient", "step1", "stepK")


def _attribute_batchnorm_cancellation(report: Report, results: dict[str, Any]) -> None:
    """Mark training-mode failures of a model whose BatchNormalization normalizes a batch that
    barely varies (``x - mean`` cancels; see ``batchnorm-cancellation``).

    Applies only when every inference-mode row passes (moving statistics involve no
    cancellation) and some BatchNormalization input has a spread below BATCHNORM_SPREAD_LIMIT.
    """
    spread = {name: value for r in results.values()
              for name, value in (r.get("batchnorm_spread") or {}).items()}
    tight = sorted(name for name, value in spread.items() if value < BATCHNORM_SPREAD_LIMIT)
    if not tight or any(not r.passed for r in report.rows if r.quantity == "forward"):
        return
    explained = False
    for row in report.failures:
        if not row.known and row.quantity in TRAINING_QUANTITIES:
            row.known = "batchnorm-cancellation"
            explained = True
    if explained:
        report.notes.append("BatchNormalization inputs that barely vary over the batch "
                            f"(std / max|x| < {BATCHNORM_SPREAD_LIMIT:g}): "
                            + ", ".join(f"{n} {spread[n]:.2g}" for n in tight))


# A run whose loss grows by this factor over its K steps is unstable (diverging).
UNSTABLE_LOSS_GROWTH = 100.0


def _attribute_unstable_training(rows: list[Row], reference: dict[str, Any]) -> None:
    """Mark the stepK failures of optimizer runs whose loss blows up (``unstable-training``).

    When the learning rate is far too large for the curvature (e.g. inputs of size 1e3 under
    SGD at lr 0.01), each step multiplies the previous step's differences by about
    lr * |x|^2, so round-off grows to visible size by step K on any two implementations. Only
    runs whose reference loss grows by UNSTABLE_LOSS_GROWTH (or stops being finite) qualify;
    their step-1 rows must still pass.
    """
    unstable = set()
    for label, run in (reference.get("steps") or {}).items():
        losses = run["losses"]
        if not all(math.isfinite(v) for v in losses) or (
                losses and abs(losses[-1]) > UNSTABLE_LOSS_GROWTH * max(abs(losses[0]), 1e-30)):
            unstable.add(label)
    for row in rows:
        if (not row.passed and not row.known and row.quantity == "stepK"
                and row.optimizer in unstable):
            row.known = "unstable-training"


def _attribute_adam_roundoff(rows: list[Row], case: Case) -> None:
    """Mark the Adam step failures of weights whose gradient is float32 round-off.

    A gradient that passes only by ``atol`` while the backends disagree relatively (max_rel >
    rtol) is noise around an exact zero (e.g. the offset of a normalization followed by another
    normalization). Adam divides the gradient by its own running magnitude, so it turns that
    noise into an update of about the learning rate whose sign and size depend on round-off:
    the two backends legitimately move such a weight differently. Only that weight's step rows
    of Adam/AdamW runs are attributed; every other row must still pass.
    """
    gradient_tol = TOLERANCES["gradient"]
    roundoff = {r.weight for r in rows if r.quantity == "gradient" and r.passed
                and r.max_rel > gradient_tol.rtol}
    nonlinear = {o.get("label", o["name"]) for o in case.optimizers
                 if o["name"] in NONLINEAR_OPTIMIZERS}
    for row in rows:
        if (not row.passed and not row.known and row.quantity in ("step1", "stepK")
                and row.optimizer in nonlinear and row.weight in roundoff):
            row.known = "adam-roundoff-gradient"


def _compare_saved(pool: WorkerPool, case: Case, weights: list[np.ndarray], saved: dict[str, str],
                   results: dict[str, Any], output_names: list[str]) -> list[Row]:
    """Each backend loads the file another one saved; compare to the saver's own predictions."""
    backends = pool.backends
    loader_of = {b: backends[(i + 1) % len(backends)] for i, b in enumerate(backends)}
    safe = safe_mode(case.source)
    loads = pool.call_each({loader_of[b]: {"path": saved[b], "x": case.x, "safe_mode": safe}
                            for b in backends}, "predict_saved")
    rows = []
    for saver, loader in loader_of.items():
        loaded = loads[loader]
        for name, a, b in zip(output_names, results[saver]["outputs"], loaded["outputs"],
                              strict=True):
            rows.append(compare_arrays("saved", f"saved on {saver}, loaded on {loader}: {name}",
                                       a, b))
        worst = max((difference(w, v) for w, v in zip(weights, loaded["weights"], strict=True)),
                    default=(0.0, 0.0))
        count_ok = len(weights) == len(loaded["weights"])
        rows.append(Row("weights", f"weights saved on {saver}, loaded on {loader}", *worst,
                        count_ok and within("weights", *worst),
                        "" if count_ok else "a different number of weights came back"))
    return rows
