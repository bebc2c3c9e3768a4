"""``kbackend study``: which batch size and optimizer reach a validation target fastest here.

``kbackend study [options]`` runs (or resumes) the grid and writes the report;
``kbackend study compare [REPORT_DIR ...]`` puts studies from different backends or devices
side by side.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path

from kbackend.adaptive import AUTO
from kbackend.commands import (
    add_reprobe_flag,
    declared_flag,
    expected_form,
    field_flags,
    int_at_least,
)
from kbackend.commands.train import add_source_arguments
from kbackend.commands.train import command_line as train_command_line
from kbackend.data.named import BUILTIN_TARGETS
from kbackend.errors import ConfigError, field_default, path_errors
from kbackend.io import check_output_folder, check_output_path
from kbackend.optim import OPTIMIZERS
from kbackend.study.config import (
    DEFAULT_BUDGETS,
    DEFAULT_DATASET,
    DEFAULT_EVALS_PER_EPOCH,
    DEFAULT_FRONTIER_EPOCHS,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_STEPS,
    DEFAULT_MODEL,
    FALLBACK_FRONTIER_EPOCHS,
    LOCAL_EXECUTOR,
    RAY_EXTRA,
    StudyConfig,
    default_frontier_epochs,
)
from kbackend.study.pipeline import compare, load_summaries, run_study, write_comparison
from kbackend.study.recommend import CONFIRM_SEEDS
from kbackend.study.targets import study_target
from kbackend.study.verdicts import DEFAULT_ACCURACY_MARGIN, DEFAULT_MARGIN, DEFAULT_MAX_SEEDS

DEFAULT_OUT = "runs/study"


_default = partial(field_default, StudyConfig)  # a field's default, stated there once


def _names(text: str) -> tuple[str, ...]:
    """The comma-separated items of ``text``, stripped, empty ones left out."""
    return tuple(v.strip() for v in text.split(",") if v.strip())


_int_list = expected_form("comma-separated integers",
                          lambda text: tuple(int(v) for v in _names(text)))
_batch_sizes = expected_form(
    "comma-separated integers and optionally 'auto'",
    lambda text: tuple(AUTO if v.lower() == AUTO else int(v) for v in _names(text)))


def _auto_or_number(what: str) -> Callable[[str], float | None]:
    """An argparse type: ``auto`` -> None (the command decides), else a number of ``what``."""
    return expected_form(f"auto or {what}",
                         lambda text: None if text.strip().lower() == "auto" else float(text))


# --cell-gpus auto: one GPU where the cluster has GPUs; --seed-budget auto: half the first
# seeds' run time.
_gpus = _auto_or_number("a number of GPUs")
_budget = _auto_or_number("seconds")


def _optimizer_rates(text: str) -> tuple[str, tuple[float, ...]]:
    """``OPT=lr1,lr2`` -> (OPT, (lr1, lr2)); a bare ``lr1,lr2`` applies to every optimizer ('*')."""
    name, _, values = text.rpartition("=")
    return name.strip() or "*", tuple(float(v) for v in _names(values))


_lr_entry = expected_form("OPTIMIZER=LR,LR,... or LR,LR,...", _optimizer_rates)


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser(
        "study", parents=parents,
        help="batch-size x optimizer study: time to a validation target, noise scale, report",
        description="Run (or resume) a grid of optimizers x batch sizes, each cell with its "
                    "learning rate tuned, and report which reaches the validation target in the "
                    "least training time on this machine. `kbackend study compare` compares "
                    "studies across backends.")
    add_reprobe_flag(parser)
    _add_grid_flags(parser)
    _add_verdict_flags(parser)
    _add_budget_flags(parser)
    _add_noise_executor_output_flags(parser)
    parser.set_defaults(func=run)

    actions = parser.add_subparsers(dest="study_action", metavar="[compare]",
                                    title="actions (optional)")
    compare = actions.add_parser("compare", parents=parents,
                                 help="compare studies (e.g. a JAX and a TF run) side by side")
    compare.add_argument("reports", nargs="*", help="report folders or summary.json files "
                         "(default: every study stored in --out)")
    compare.add_argument("--out", default=DEFAULT_OUT, help=f"study folder (default {DEFAULT_OUT})")
    compare.set_defaults(func=run_compare, needs_backend=False)



def _add_grid_flags(parser: argparse.ArgumentParser) -> None:
    """The grid: model and data, optimizers, batch sizes, learning rates, seeds."""
    grid = parser.add_argument_group("grid")
    add_source_arguments(grid, grid, dataset=DEFAULT_DATASET, model_default=DEFAULT_MODEL,
                         dataset_help=f"default {DEFAULT_DATASET}: MNIST-1D drawn larger, "
                                      "generated offline",
                         model_help=f"; default {DEFAULT_MODEL}, hidden widths 256,128")
    grid.add_argument("--optimizers", type=_names, default=_default("optimizers"),
                      help=f"comma-separated, from {', '.join(OPTIMIZERS)} "
                           "(default: sgd,momentum,adam)")
    grid.add_argument("--batch-sizes", type=_batch_sizes, default=None,
                      help="comma-separated (default: powers of two from 8 to half the "
                           "training split); 'auto' among them adds an adaptive batch-size "
                           "cell per optimizer, from the smallest to the largest (native engine)")
    declared_flag(grid, "--lr-scaling", StudyConfig,
                  help="how the auto cell's learning rate follows its batch (default: sqrt)")
    grid.add_argument("--max-batch-size", type=int, default=_default("max_batch_size"),
                      help="cap the default batch sizes (0: the dataset's default cap, "
                           f"{DEFAULT_DATASET} {DEFAULT_MAX_BATCH[DEFAULT_DATASET]}; else none)")
    grid.add_argument("--lrs", type=_lr_entry, action="append", default=None, metavar="[OPT=]LR,LR",
                      help="explicit learning-rate grid, per optimizer (repeatable) or for all")
    declared_flag(grid, "--lr-grid-size", StudyConfig, type=int,
                  help="learning rates tried per cell when --lrs is not given (default 3)")
    declared_flag(grid, "--lr-factor", StudyConfig, type=float,
                  help="ratio between neighbouring learning rates (default sqrt(10))")
    grid.add_argument("--no-prune", dest="prune", action="store_false",
                      help="give every learning rate the full budget (default: later rates of a "
                           "cell get the best steps-to-target so far as budget)")
    grid.add_argument("--lr-extend", type=int, default=_default("lr_extend"),
                      help="extra learning rates a cell may add beyond each end of its grid while "
                           "its best rate sits on that end (default 2; 0: never extend)")
    grid.add_argument("--seed", type=int, default=_default("seed"),
                      help="first seed (default 0)")
    declared_flag(grid, "--seeds", StudyConfig, type=int,
                  help="seeds per learning rate (initial weights and data order): seed, "
                       "seed+1, ...; figures are medians over them (default 3)")


def _add_verdict_flags(parser: argparse.ArgumentParser) -> None:
    """Verdicts, added seeds and the frontier."""
    verdicts = parser.add_argument_group("verdicts, sequential seeds and the frontier")
    verdicts.add_argument("--max-seeds", type=int, default=DEFAULT_MAX_SEEDS,
                          help="add seeds, round by round, to the cells whose verdicts are "
                               "unresolved and could still resolve, up to this many (default "
                               f"{DEFAULT_MAX_SEEDS}; --max-seeds equal to --seeds: none added)")
    verdicts.add_argument("--confirm-seeds", type=int_at_least(0), default=CONFIRM_SEEDS,
                          metavar="N",
                          help="run the recommended cell's printed `kbackend train` command on N "
                               "held-out seeds and report what it reached (default "
                               f"{CONFIRM_SEEDS}; 0: off)")
    verdicts.add_argument("--seed-budget", type=_budget, default=None, metavar="SECONDS|auto",
                          help="stop adding seeds once their runs took this many seconds "
                               "(default auto: half the recorded time of the grid's runs; 0: no "
                               "limit; the frontier runs come after, outside it)")
    declared_flag(verdicts, "--margin", StudyConfig, type=float,
                  help="equivalence margin of times, steps and error metrics, relative "
                       f"(default {DEFAULT_MARGIN:g}: within {1 + DEFAULT_MARGIN:g}x; "
                       "a difference "
                       "smaller than a shared machine's timing spread)")
    declared_flag(verdicts, "--accuracy-margin", StudyConfig, type=float,
                  help="equivalence margin of accuracies, absolute (default "
                       f"{DEFAULT_ACCURACY_MARGIN:g}: one percentage point)")
    verdicts.add_argument("--frontier-epochs", type=int, default=None,
                          help="equal budget, in epochs, of the runs that measure the best "
                               "validation value each cell reaches (default per dataset: "
                               + ", ".join(f"{k} {v}" for k, v in DEFAULT_FRONTIER_EPOCHS.items())
                               + f", else {FALLBACK_FRONTIER_EPOCHS}; 0: none; native engine)")


def _add_budget_flags(parser: argparse.ArgumentParser) -> None:
    """The target, each run's budget, the engine and how it trains."""
    target = parser.add_argument_group("target and budget")
    target.add_argument("--target", type=float, default=None,
                        help="validation target value (default: the dataset's own, e.g. "
                             + ", ".join(f"{name} {BUILTIN_TARGETS[name].value:g}" for name in
                                         ("mnist1d_large", "digits", "mnist"))
                             + "; required with --data)")
    target.add_argument("--target-metric", default="val_accuracy", metavar="METRIC",
                        help="val_loss or val_<the model's metric>, e.g. val_mae (default "
                             "val_accuracy; accuracies >=, losses and errors <=)")
    target.add_argument("--max-steps", type=int, default=None,
                        help=f"step budget per run (default {DEFAULT_MAX_STEPS}; mnist "
                             f"{DEFAULT_BUDGETS['mnist'][0]}, mnist1d_large "
                             f"{DEFAULT_BUDGETS['mnist1d_large'][0]})")
    target.add_argument("--max-epochs", type=int, default=None,
                        help="also cap each run at this many epochs, so small batches can have a "
                             "large --max-steps without large batches running as many steps "
                             f"(default 0: no epoch cap; mnist {DEFAULT_BUDGETS['mnist'][1]}, "
                             f"mnist1d_large {DEFAULT_BUDGETS['mnist1d_large'][1]})")
    target.add_argument("--evals-per-epoch", type=int, default=DEFAULT_EVALS_PER_EPOCH,
                        help="how often the target is checked (engines that validate once per "
                             "epoch ignore it)")
    declared_flag(target, "--engine", StudyConfig,
                  help="training engine (default: %(default)s)")
    target.add_argument("--fused-steps", type=int, default=_default("fused_steps"),
                        help="steps per compiled call for the native engine (0: one evaluation "
                             "interval)")
    target.add_argument("--no-jit", dest="jit_compile", action="store_false",
                        help="train the Keras engines and TensorFlow's native loop without XLA "
                             "(JAX's native loop is always one XLA program)")
    declared_flag(target, "--population", StudyConfig,
                  help="train a cell's learning rates x seeds as one vmapped program (JAX, "
                       "native engine): auto = where a short measured probe finds it "
                       "faster (default auto)")
    target.add_argument("--step-time-repeats", type=int, default=_default("step_time_repeats"),
                        help="interleaved rounds timing each cell's steady step apart: time to "
                             "target = median steps x median step time (0: the runs' own "
                             f"clocks; default {StudyConfig.step_time_repeats})")


def _add_noise_executor_output_flags(parser: argparse.ArgumentParser) -> None:
    """The gradient noise scale, where the cells run, and what is written."""
    noise = parser.add_argument_group("gradient noise scale")
    noise.add_argument("--noise-points", type=int, default=_default("noise_points"),
                       help="points along training where B_simple is measured (0: skip)")
    noise.add_argument("--noise-draws", type=int, default=_default("noise_draws"),
                       help="batch pairs per point")
    noise.add_argument("--noise-batches", type=_int_list, default=(0, 0), metavar="SMALL,BIG",
                       help="the two batch sizes of the estimator (default: smallest and "
                            "largest of the grid)")
    where = parser.add_argument_group("where the cells run (docs/cluster.md)")
    where.add_argument("--executor", default=LOCAL_EXECUTOR, metavar="local|ray[:ADDRESS]",
                       help="local: one cell after another here (default); ray: each cell a Ray "
                            "task, on a Ray instance started here (127.0.0.1) or on the cluster "
                            f"at ADDRESS (needs the extra: pip install '{RAY_EXTRA}')")
    where.add_argument("--workers", type=int, default=_default("workers"),
                       help="--executor ray without an address: cells at once (the local "
                            "instance's CPUs; default 0: one per core)")
    declared_flag(where, "--cell-cpus", StudyConfig, type=float,
                  help="CPUs each cell's Ray task asks for (default 1)")
    where.add_argument("--cell-gpus", type=_gpus, default=None, metavar="auto|N",
                       help="GPUs each cell's Ray task asks for; a fraction packs cells on one "
                            "GPU, e.g. 0.25: four (default auto: 1 where the cluster has GPUs, "
                            "else 0)")
    output = parser.add_argument_group("output")
    output.add_argument("--device-profile", default=None, metavar="FILE",
                        help="a step-time curve measured on another device for this model (JSON "
                             '{"device": ..., "step_time_s": {"32": 0.0011, ...}}, or `kbackend '
                             "advise --json` output): the report adds each cell's time to "
                             "target predicted there (steps here x its step times)")
    output.add_argument("--out", default=DEFAULT_OUT,
                        help=f"folder for study.db and the reports (default {DEFAULT_OUT})")
    output.add_argument("--tensorboard", default=None, metavar="DIR",
                        help="also write a TensorBoard run folder per run (each evaluation's "
                             "scalars) and the HParams experiment (optimizer, batch size, rate; "
                             "steps and time to target, best validation value) to DIR; needs "
                             "the tensorboard extra")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")

def config_from_args(args: argparse.Namespace) -> StudyConfig:
    """The ``StudyConfig`` the flags describe (validated)."""
    learning_rates: dict[str, tuple[float, ...]] = {}
    for name, values in args.lrs or []:
        for optimizer in (args.optimizers if name == "*" else (name,)):
            learning_rates[optimizer] = values
    target = study_target(args.model, args.data or args.dataset, args.target,
                          args.target_metric, label=args.label, data_dir=args.data_dir,
                          unsafe_deserialization=args.unsafe_deserialization)
    frontier_epochs = (default_frontier_epochs(args.data or args.dataset)
                       if args.frontier_epochs is None else args.frontier_epochs)
    if len(args.noise_batches) != 2:
        raise ConfigError(f"Invalid --noise-batches {args.noise_batches}: expected SMALL,BIG.")
    # every flag named as its field passes through; the others are derived above
    return StudyConfig(**{**field_flags(args, StudyConfig), "dataset": args.data or args.dataset,
                          "target": target, "learning_rates": learning_rates,
                          "frontier_epochs": frontier_epochs,
                          "noise_small_batch": args.noise_batches[0],
                          "noise_big_batch": args.noise_batches[1]})


def run(args: argparse.Namespace) -> int:
    check_output_folder(args.out, "--out")
    run_study(config_from_args(args), args.out, show_progress=not args.no_progress,
              tensorboard=args.tensorboard, command_line=train_command_line,
              confirm_seeds=args.confirm_seeds)
    return 0


def run_compare(args: argparse.Namespace) -> int:
    for flag, path in [*(("report path", r) for r in args.reports), ("--out", args.out)]:
        with path_errors(path, flag):  # a name the system cannot look at: one line
            Path(path, "summary.json").exists()
    summaries = load_summaries(args.reports, args.out)
    check_output_path(Path(args.out) / "compare.md", "--out")
    print(compare(summaries))
    path = write_comparison(summaries, Path(args.out) / "compare.md")
    print(f"wrote {path}")
    return 0
