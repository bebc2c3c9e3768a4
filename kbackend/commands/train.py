"""``kbackend train``: train a model on a dataset and report validation and test metrics."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from kbackend.adaptive import AutoBatchSize, parse_batch_size
from kbackend.backend_choice import active_backend
from kbackend.commands import (
    OneLineErrorParser,
    add_import_flag,
    add_reprobe_flag,
    declared_flag,
    expected_form,
    field_flags,
    int_at_least,
)
from kbackend.config import MONITORS, Target, TrainConfig
from kbackend.data import DATA_FORMATS, DATASETS
from kbackend.data.user import MAX_IMAGE_PIXELS, parse_image_size
from kbackend.distributed import engine_name, is_chief, prepare
from kbackend.engine_facts import engine_facts
from kbackend.errors import ConfigError, DataError, KBackendError, field_default
from kbackend.hardware.monitor import format_summary
from kbackend.io import check_distinct_paths, check_output_path
from kbackend.model_sources import parse_model_source
from kbackend.models import MODELS, READOUTS, ModelOptions
from kbackend.optim import OPTIMIZERS, SCHEDULES, OptimizerSpec
from kbackend.progress import EpochReporter
from kbackend.study.summaries import time_to_target
from kbackend.tensorboard_logs import check_logdir
from kbackend.training import for_task, train, workload_of
from kbackend.workload import WARNING

# an empty item is an error, not dropped
_widths = expected_form("comma-separated integers",
                        lambda text: tuple(int(w) for w in text.split(",")))


def _image_size(text: str) -> tuple[int, int]:
    try:
        return parse_image_size(text)
    except DataError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _batch_size(text: str) -> int | AutoBatchSize:
    try:
        return parse_batch_size(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_model = partial(field_default, ModelOptions)
_optimizer = partial(field_default, OptimizerSpec)


def add_source_arguments(data: Any, model: Any, *, dataset: str, model_default: str,
                         dataset_help: str | None = None, model_help: str = "") -> None:
    """The flags naming the model and the data, a built-in or the user's (train and study)."""
    data.add_argument("--dataset", default=dataset, choices=sorted(DATASETS), help=dataset_help)
    data.add_argument("--data", default=None, metavar="SOURCE",
                      help="your data instead of --dataset: PATH.npz, PATH.csv (with --label), a "
                           "folder of class subfolders (images or .txt), tfds:NAME[:CONFIG], "
                           "FILE.py:FUNCTION (docs/your-model.md)")
    data.add_argument("--label", default=None, metavar="COLUMN",
                      help="--data PATH.csv: the label column")
    data.add_argument("--image-size", default=None, type=_image_size, metavar="HxW",
                      help="--data FOLDER of images: read every image at this size (default: "
                           "the first image's; needed for images over "
                           f"{MAX_IMAGE_PIXELS:,} pixels)")
    data.add_argument("--data-dir", default=None, help="folder with MNIST / Fashion-MNIST files")
    model.add_argument("--model", default=model_default, metavar="MODEL",
                       help=f"a built-in model ({', '.join(sorted(MODELS))}{model_help}), your "
                            "PATH.keras, or a builder FILE.py:FUNCTION / package.module:FUNCTION")
    model.add_argument("--unsafe-deserialization", action="store_true",
                       help="--model PATH.keras: load Lambda layers (their code runs)")
    add_import_flag(model)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``kbackend train`` (also parsed by ``kbackend launch`` before it starts)."""
    data = parser.add_argument_group("data (docs/your-model.md)")
    model = parser.add_argument_group("model")
    add_source_arguments(data, model, dataset=field_default(TrainConfig, "dataset"),
                         model_default=field_default(TrainConfig, "model"))
    model.add_argument("--from-weights", action="store_true",
                       help="--model PATH.keras: start from its saved weights (default: fresh "
                            "weights from its initializers, per seed)")
    declared_flag(data, "--validation-fraction", TrainConfig, type=float,
                  help="share of the training data held out for validation (no early stopping "
                       "or target without one)")
    model.add_argument("--data-format", default=_model("data_format"),
                       choices=list(DATA_FORMATS))
    model.add_argument("--dropout", type=float, default=_model("dropout"))
    model.add_argument("--batch-norm", action="store_true")
    model.add_argument("--l2", type=float, default=_model("l2"))
    model.add_argument("--widths", type=_widths, default=_model("widths"),
                       help="hidden widths of --model mlp, e.g. 512,256")
    model.add_argument("--residual", action="store_true",
                       help="--model mlp: add each hidden layer's input to its output where the "
                            "widths match")
    model.add_argument("--filters", type=_widths, default=_model("filters"),
                       help="channels of each conv layer of --model cnn/cnn1d/cnn2d, e.g. 25,25,25")
    model.add_argument("--units", type=int, default=_model("units"), help="--model gru: state size")
    model.add_argument("--bidirectional", action="store_true", help="--model gru: read both ways")
    model.add_argument("--readout", default=_model("readout"), choices=list(READOUTS),
                       help="--model gru: the last state, or all steps' states flattened, into "
                            "the classifier")
    hardware = parser.add_argument_group("hardware (see docs/hardware.md)")
    declared_flag(hardware, "--precision", TrainConfig,
                  help="Keras dtype policy (mixed_float16 adds loss scaling)")
    hardware.add_argument("--monitor", "--hardware-monitor", dest="hardware_monitor",
                          action="store_true",
                          help="record per-step input wait vs compute, utilization and device "
                               "memory; print a verdict (input- or compute-bound)")
    optim = parser.add_argument_group("optimizer")
    optim.add_argument("--optimizer", default=_optimizer("name"), choices=list(OPTIMIZERS))
    optim.add_argument("--lr", "--learning-rate", dest="lr", type=float,
                       default=_optimizer("learning_rate"))
    optim.add_argument("--schedule", default=_optimizer("schedule"), choices=list(SCHEDULES))
    optim.add_argument("--warmup-steps", type=int, default=_optimizer("warmup_steps"))
    optim.add_argument("--momentum", type=float, default=_optimizer("momentum"))
    optim.add_argument("--weight-decay", type=float,
                       default=_optimizer("weight_decay"))
    _add_run_arguments(parser)
    add_parallel_arguments(parser)
    add_reprobe_flag(parser)
    parser.add_argument("--save", default=None, metavar="MODEL.keras",
                        help="save the trained model")
    parser.add_argument("--history", default=None, metavar="HISTORY.json",
                        help="write the history as JSON")
    parser.add_argument("--tensorboard", default=None, metavar="DIR",
                        help="write TensorBoard event files to DIR: loss, the metric, learning "
                             "rate, samples/s (and the batch size of --batch-size auto) at each "
                             "evaluation")
    parser.add_argument("--quiet", action="store_true", help="no per-epoch lines")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """How the run trains: engine, batch size, epochs and steps, evaluation, stopping."""
    run = parser.add_argument_group("run")
    declared_flag(run, "--engine", TrainConfig,
                  extra_choices=[AUTO_ENGINE],
                  help="native: K train steps per compiled call (docs/engines.md); keras: "
                       "Keras fit; auto: picked for the data, said why")
    run.add_argument("--batch-size", type=_batch_size,
                     default=field_default(TrainConfig, "batch_size"), metavar="N|auto[:MIN:MAX]",
                     help="samples per step; auto: grow it with the measured gradient noise "
                          "scale between MIN (default 8) and MAX (default: this machine's "
                          "throughput knee), powers of two (docs/adaptive.md)")
    declared_flag(run, "--lr-scaling", TrainConfig, default=None,
                  help="--batch-size auto: how the learning rate (the rate at MIN) follows "
                       "the batch (adascale: AdaScale's gain from the same estimate; "
                       "default sqrt)")
    declared_flag(run, "--epochs", TrainConfig, type=int)
    run.add_argument("--no-jit", dest="jit_compile", action="store_false",
                     help="turn off jit_compile (XLA): the Keras engines and TensorFlow's native "
                          "loop run as graphs without XLA (JAX's native loop is always one XLA "
                          "program)")
    declared_flag(run, "--steps-per-execution", TrainConfig, type=int)
    declared_flag(run, "--early-stopping", TrainConfig, type=int, metavar="PATIENCE",
                  help="stop after PATIENCE evaluations without improvement of "
                       "--early-stopping-metric")
    run.add_argument("--early-stopping-metric", dest="monitor", default=None, metavar="METRIC",
                     help="val_loss or val_<the model's metric> (default: the metric, e.g. "
                          "val_accuracy)")
    declared_flag(run, "--seed", TrainConfig, type=int)
    run.add_argument("--fused-steps", type=int_at_least(1, auto=True), default=None, metavar="K",
                     help="--engine native: train steps per compiled device call (K), or "
                          "'auto' (the fastest of a few, measured once per machine and model) "
                          "(default: auto on one device, 1 otherwise)")
    declared_flag(run, "--max-steps", TrainConfig, type=int, metavar="N",
                  help="stop after N train steps (0: --epochs decides)")
    run.add_argument("--no-shuffle", dest="shuffle", action="store_false",
                     help="every epoch in the dataset's order (default: a fresh order per epoch "
                          "from --seed)")
    declared_flag(run, "--eval-every", TrainConfig, type=int, metavar="STEPS",
                  help="validate every STEPS steps (0: once per epoch; the keras engine "
                       "validates per epoch only)")
    run.add_argument("--target", type=float, default=None, metavar="VALUE",
                     help="stop at the first evaluation that reaches VALUE of --target-metric")
    run.add_argument("--target-metric", default=None, metavar="METRIC",
                     help="the metric --target applies to: val_loss or val_<the model's metric> "
                          f"(default {MONITORS[0]}; accuracies >=, losses and errors <=)")

def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` the parsed flags describe (validated)."""
    spec = OptimizerSpec(
        name=args.optimizer, learning_rate=args.lr, schedule=args.schedule,
        warmup_steps=args.warmup_steps, momentum=args.momentum, weight_decay=args.weight_decay,
    )
    options = ModelOptions(**field_flags(args, ModelOptions))
    if args.lr_scaling is not None and not isinstance(args.batch_size, AutoBatchSize):
        raise ConfigError(f"--lr-scaling {args.lr_scaling} sets how the learning rate follows "
                          "a growing batch: it needs --batch-size auto[:MIN:MAX], and this run's "
                          f"batch is fixed at {args.batch_size}.")
    # The model source's cheap checks (files, syntax, safe mode) before any work (the data is
    # read, and checked, by ``workload_of``). A built-in's metric is known from its name;
    # another model's once it is built (_prepared).
    default_metric = parse_model_source(
        args.model, unsafe_deserialization=args.unsafe_deserialization,
        from_weights=args.from_weights).default_metric
    target_metric = args.target_metric or default_metric or "val_loss"
    # every flag named as its field passes through; the others are derived here
    config = TrainConfig(**{
        **field_flags(args, TrainConfig), "dataset": args.data or args.dataset, "optimizer": spec,
        "model_options": options, "lr_scaling": args.lr_scaling or "sqrt",
        "engine": resolve_engine(args.engine)[0],
        "monitor": args.monitor or target_metric,
        "fused_steps": 1 if args.fused_steps is None else args.fused_steps,
        "target": None if args.target is None else Target(target_metric, args.target)})
    if args.fused_steps is None:  # the engine's own: single-device native measures K (cached)
        config = replace(config, fused_steps=engine_facts(engine_name(config)).default_fused_steps)
    return config


AUTO_ENGINE = "auto"


def adaptive_summary(record: dict[str, Any]) -> str:
    """One line of an adaptive run's batch sizes, each with the step it took over."""
    probe = record.get("knee_probe")
    bound = "" if probe is None else \
        f" ({probe.get('note', 'MAX: the throughput knee')}; {_probe_source(probe)})"
    sizes = " -> ".join(f"{r['batch_size']} (step {r['step']}, lr {r['learning_rate']:.3g})"
                        for r in record["ranges"])
    estimate = record.get("b_simple")
    last = f"; last B_simple ~ {estimate:.0f}" if estimate is not None else ""
    return (f"batch size auto:{record['min']}:{record['max']}{bound}, lr scaling "
            f"{record['lr_scaling']}: {sizes}{last}")


def _probe_source(probe: dict[str, Any]) -> str:
    """Where a probe's answer came from: the per-machine store, or a measurement just now."""
    return "stored probe" if probe.get("cached") else f"measured in {probe['seconds']:.1f}s"


def resolve_engine(engine: str) -> tuple[str, str | None]:
    """The engine ``--engine`` names, and for ``auto`` the reason it was picked."""
    if engine != AUTO_ENGINE:
        return engine, None
    # Every source is read into memory (kbackend.data.user), so each engine can run it; the
    # native engine is the fastest measured at every batch size (docs/engines.md).
    return "native", ("engine auto: native (the data is in memory, and the native engine's "
                      "fused steps are the fastest measured: docs/engines.md)")


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser("train", parents=parents,
                                   help="train a model and report metrics")
    add_train_arguments(parser)
    parser.set_defaults(func=run)


def command_line(argv: Sequence[str]) -> int:
    """``kbackend train ARGV`` (``argv[0]`` is ``"train"``) as the command line runs it in this
    process, its parser, checks and ``run``; the exit status (2 for bad input, with the
    one-line error on stderr). A study confirms its printed command through this."""
    parser = OneLineErrorParser(prog="kbackend train")
    add_train_arguments(parser)
    try:
        args = parser.parse_args(list(argv)[1:])
        return int(run(args) or 0)
    except KBackendError as error:
        sys.stderr.write(f"kbackend: error: {error}\n")
        return error.exit_status
    except SystemExit as exit_:  # argparse's own errors
        return exit_.code if isinstance(exit_.code, int) else 2


def check_args(args: argparse.Namespace) -> TrainConfig:
    """The validated ``TrainConfig`` of the flags (the model source's checks among them), with
    the output paths checked (no data needed): ``--save`` (.keras), ``--history`` (.json) and
    ``--tensorboard`` writable, and none another or an input (the model or data file)."""
    config = config_from_args(args)
    outputs = {"--save": args.save, "--history": args.history}
    inputs = {"--model": config.model, "--data": config.dataset}
    check_distinct_paths(outputs, inputs)
    for (flag, path), suffix in zip(outputs.items(), (".keras", ".json"), strict=True):
        if path is not None:
            check_output_path(path, flag, suffix=suffix)
    if args.tensorboard is not None:
        check_logdir(args.tensorboard, inputs={**inputs, **outputs})
    return config


def _prepared(args: argparse.Namespace, config: TrainConfig) -> tuple[TrainConfig, Any]:
    """The run's model and data prepared as a ``Workload`` (built-in names are sources like
    any other; the notes printed) and ``config`` made to name the model's own task and metric
    where the flags left them to the defaults."""
    # Virtual devices and a multi-process job must exist before the framework starts, and
    # preparing the model and data starts it (training.train's own call to prepare then finds
    # both done).
    prepare(config)
    workload = workload_of(config)
    for note in workload.notes:
        print(note, file=sys.stderr if note.startswith(WARNING) else sys.stdout)
    if workload.says_task:
        print(f"{workload.model_name}: {workload.task.describe()}")
    config = for_task(config, workload.task, target=args.target,
                      target_metric=args.target_metric, monitor=args.monitor)
    return config, workload


def _engine_lines(record: Any) -> None:
    """The native engines' K and how it was chosen; an adaptive batch size's step ranges."""
    if record.fused_steps is not None:
        probe = record.fused_steps_probe
        how = "" if probe is None else f" (auto: {_probe_source(probe)})"
        if record.fused_steps_asked is not None:
            how = (f" (asked {record.fused_steps_asked}: this model's steps are "
                   "written out one after another here, so a call holds at most "
                   f"{record.fused_steps})")
        print(f"fused steps K={record.fused_steps}{how}")
    if record.adaptive_batch is not None:  # --batch-size auto: each step range
        print(adaptive_summary(record.adaptive_batch))


def _result_lines(config: TrainConfig, history: Any) -> None:
    """The metrics line (one training time per run) and, with a target, where it was reached
    in the study's vocabulary of times (docs/study.md)."""
    record, nan = history.record, float("nan")
    metric, test_metric = f"val_{config.task.metric}", f"test_{config.task.metric}"
    best = history.best(metric)
    last = history.evals[-1] if history.evals else {}
    compile_time = history.timing.get("compile_time")
    train_time = history.timing.get("train_time", nan) - (compile_time or 0.0)
    print(
        f"{metric} {last.get(metric, nan):.4f} (best {best if best is not None else nan:.4f})  "
        f"{test_metric} {history.test.get(test_metric, nan):.4f}  "
        f"test_loss {history.test['test_loss']:.4f}  "
        # one training time per run: with a target reached, its line below has the times
        + ("" if record.target_reached else f"train_time {train_time:.2f}s"
           + (f" (compiled in {compile_time:.2f}s apart)" if compile_time is not None else "")
           + "  ")
        + f"steps {history.steps_run}"
    )
    if config.target is None:
        return
    target, reached = config.target, record.target_reached
    relation = ">=" if target.direction == "max" else "<="
    if reached:
        time, wall = time_to_target(history)
    print(f"target {target.metric} {relation} {target.value:g}: " + (
        f"reached at step {reached['step']}: time to target {time:.2f}s (wall to target "
        f"{wall:.2f}s, start-up included)"
        if reached else f"not reached in {history.steps_run} steps"))


def run(args: argparse.Namespace) -> int:
    config = check_args(args)
    why = resolve_engine(args.engine)[1]
    if why:
        print(why)
    reporter = None if args.quiet else EpochReporter()
    config, workload = _prepared(args, config)
    result = train(config, reporter=reporter, save=args.save, history_path=args.history,
                   workload=workload, tensorboard=args.tensorboard)
    history = result.history
    info = result.dataset.info
    print(
        f"{config.model} on {info.name} ({info.num_train} train / "
        f"{'test split as val' if info.val_is_test else f'{info.num_val} val'} / "
        f"{info.num_test} test), {config.optimizer.name} lr={config.optimizer.learning_rate:g}, "
        f"batch {config.batch_size}, engine {engine_name(config)}, backend {active_backend()}"
    )
    _engine_lines(history.record)
    _result_lines(config, history)
    if history.record.monitor is not None:
        print(format_summary(history.record.monitor))
    if args.save and is_chief():  # in a multi-process job only process 0 writes
        print(f"saved model to {args.save}")
    if args.history and is_chief():
        print(f"wrote history to {args.history}")
    return 0


# --- parallel (issue 6) ---
def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Data-parallel and multi-process flags (see docs/parallel.md)."""
    group = parser.add_argument_group("parallel")
    declared_flag(group, "--devices", TrainConfig, type=int, metavar="N",
                  help="split each batch over N devices (> 1 implies --data-parallel)")
    group.add_argument("--data-parallel", action="store_true",
                       help="run the data-parallel version of --engine (keras: DataParallel / "
                            "MirroredStrategy; native: the shard_map engine)")
    declared_flag(group, "--dp-impl", TrainConfig,
                  help="how the data_parallel engine maps its step onto devices")
    declared_flag(group, "--virtual-devices", TrainConfig, type=int, metavar="N",
                  help="split the host CPU into N virtual devices (for trying it on a laptop)")
    declared_flag(group, "--num-processes", TrainConfig, type=int, metavar="N",
                  help="processes in a multi-process job (see kbackend launch)")
    group.add_argument("--process-id", type=int, default=0, metavar="I",
                       help="this process's index")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="address of process 0 in a multi-process job")
    declared_flag(group, "--coordinator-timeout", TrainConfig, type=int,
                  metavar="SECONDS", help="how long to wait for the coordinator or a collective")
    declared_flag(group, "--heartbeat-timeout", TrainConfig, type=int,
                  metavar="SECONDS",
                  help="a peer silent this long counts as dead and stops the job")
