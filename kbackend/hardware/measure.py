"""The measurement harness: every figure kbackend measures on this machine and keeps.

Three parts, each in one place:

- **Timing** (``time_interleaved``): configurations timed in interleaved rounds, one call of
  each per round (``best_of`` back to back, the fastest kept), the order rotated by one every
  round, so that a burst of load on a shared machine hits every configuration alike and each
  round gives a paired ratio (``paired_ratios``); each one's first (compiling) call is made and
  timed apart. A figure comes with its noise: ``Timing`` keeps the median
  (``stats.median_interval``), the repeats' coefficients of variation and the repeats
  themselves. The clock is an argument (tests slow it on purpose to stand for a busy machine);
  ``Budget`` bounds the re-measurements of a noisy figure.
- **The key** (``measurement_key``): what a probe's answer depends on in the workload, the same
  for every probe: the network's layers and weight shapes (not their names or values) and dtype
  policy, the data's sample shape and size, and the probe's own options. The machine (backend,
  versions, device, processor) and the probe's format are the entry's stamp (``machine_stamp``),
  not part of the key: an entry from another machine or version is found, ignored with a
  ``MeasurementWarning`` and measured again.
- **The store** (``remembered``): one JSON file per probe (``PROBES``) in the kbackend cache
  folder, written atomically; a damaged file is kept as a backup, a damaged entry or one without
  a stamp (written before this harness) is dropped with a warning, the others kept;
  ``--reprobe`` measures each entry again once per process; ``stored_probes`` lists them
  (``kbackend info``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kbackend.backends import impl
from kbackend.backends.compile_cache import compile_cache_enabled
from kbackend.data.sources import cache_dir
from kbackend.envinfo import environment_identity
from kbackend.errors import StoredFileError
from kbackend.io import atomic_write_json, read_json

Clock = Callable[[], float]
K = TypeVar("K", bound=Hashable)
NOISY_CV = 0.10  # repeats that vary more than this (robust sd / median) make a noisy figure
# The median absolute deviation times this estimates a normal spread's sd; unlike the sample
# sd, one stalled call among the repeats (a shared machine's burst) does not move it.
ROBUST_SD = 1.4826


# -- timing ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median of the repeats (``times``, in order: one per round when
    interleaved), their coefficient of variation ``cv`` (std / mean, the figure stored with
    timings) and ``robust_cv`` (``ROBUST_SD`` x the median absolute deviation, over the median;
    the one ``noisy`` reads), both NaN for fewer than two, and the first (compiling) call's
    time (NaN when not made).
    """

    median_s: float
    cv: float
    first_call_s: float
    times: tuple[float, ...]
    calls: int = 1  # calls per timed repeat (each repeat's time is per call)
    robust_cv: float = math.nan

    @property
    def noisy(self) -> bool:
        """Whether the repeats vary by more than ``NOISY_CV`` (``robust_cv``: a stalled repeat
        or two of five do not count; on normal noise, five repeats read a cv of 0.10 as about
        0.08, so the bound acts like 12 % there)."""
        return bool(self.robust_cv > NOISY_CV)


def summarize(first_call_s: float, repeat_times: Sequence[float], calls: int = 1) -> Timing:
    """A ``Timing`` from the first call's time and the steady repeats' times per call (each of
    ``calls`` calls)."""
    times = np.asarray(repeat_times if len(repeat_times) else [first_call_s], dtype=float)
    median = float(np.median(times))
    mean = float(np.mean(times))
    several = times.size > 1 and median > 0
    cv = float(np.std(times, ddof=1) / mean) if several else math.nan
    spread = ROBUST_SD * float(np.median(np.abs(times - median)))
    return Timing(median, cv, float(first_call_s), tuple(float(t) for t in repeat_times), calls,
                  spread / median if several else math.nan)


def _timed(fn: Callable[[], Any], wait: Callable[[Any], Any], clock: Clock,
           calls: int = 1) -> float:
    """Seconds per call of ``calls`` calls of ``fn`` back to back, each waited on."""
    start = clock()
    for _ in range(calls):
        wait(fn())
    return (clock() - start) / calls


def time_interleaved(fns: Mapping[K, Callable[[], Any]], rounds: int,
                     wait: Callable[[Any], Any] | None = None, clock: Clock = time.perf_counter,
                     first_calls: bool = True, best_of: int = 1,
                     previous: Mapping[K, Timing] | None = None,
                     min_seconds: float = 0.0) -> dict[K, Timing]:
    """Time every function of ``fns`` over ``rounds`` rounds: in each round ``best_of`` calls
    of each back to back (the fastest kept, as timeit does: load only ever slows a call), the
    order rotated by one each round (none is always first after a pause). Each one's first call
    (compiling) is made and timed apart beforehand unless ``first_calls`` is False. ``wait``
    blocks on a call's result (default: the backend's ``block_until_ready``, so asynchronous
    dispatch never stops a timer early). ``previous``: earlier timings of the same functions,
    whose rounds the new ones extend (their first calls and calls per repeat kept).
    ``min_seconds``: a repeat of a short call runs it as many times back to back as three more
    calls (untimed for the figure) say make about that long, and keeps the time per call: a
    call of a few milliseconds varies by 10-20 % on a shared machine, a tenth of a second of
    them far less."""
    if wait is None:
        wait = impl().block_until_ready
    keys = list(fns)
    first = {key: previous[key].first_call_s if previous
             else _timed(fns[key], wait, clock) if first_calls else math.nan for key in keys}
    calls = {key: previous[key].calls if previous else _calls_for(fns[key], wait, clock,
                                                                   min_seconds)
             for key in keys}
    times: dict[K, list[float]] = {key: list(previous[key].times) if previous else []
                                   for key in keys}
    for round_index in range(rounds):
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            times[key].append(min(_timed(fns[key], wait, clock, calls[key])
                                  for _ in range(best_of)))
    return {key: summarize(first[key], times[key], calls[key]) for key in keys}


def _calls_for(fn: Callable[[], Any], wait: Callable[[Any], Any], clock: Clock,
               min_seconds: float) -> int:
    """Calls per repeat that last about ``min_seconds`` at least, from the median of three
    calls' times (1 without a minimum)."""
    if min_seconds <= 0:
        return 1
    seconds = float(np.median([_timed(fn, wait, clock) for _ in range(3)]))
    return max(1, math.ceil(min_seconds / seconds)) if seconds > 0 else 1


def paired_ratios(numerator: Timing, denominator: Timing) -> list[float]:
    """Round-by-round ``numerator / denominator`` of two interleaved timings' calls (as many
    rounds as both have)."""
    return [a / b for a, b in zip(numerator.times, denominator.times, strict=False) if b > 0]


class Budget:
    """The re-measurements a probe may still make: at most ``most``, while its ``clock`` has
    run less than ``seconds`` since the probe began; both are recorded (``record``)."""

    def __init__(self, seconds: float, most: int, clock: Clock) -> None:
        self.seconds, self.most, self.clock = seconds, most, clock
        self.started, self.used = clock(), 0

    def take(self) -> bool:
        """Whether one more re-measurement fits (counted if so)."""
        if self.used >= self.most or self.clock() - self.started >= self.seconds:
            return False
        self.used += 1
        return True

    def record(self) -> dict[str, Any]:
        return {"remeasured": self.used, "probe_seconds": self.clock() - self.started,
                "budget_s": self.seconds}


# -- the key ---------------------------------------------------------------------------------
def measurement_key(model: Any, dataset: Any, **options: Any) -> str:
    """What a probe's answer depends on in the workload (module docstring), as a digest:
    ``model``'s layers, weight shapes and dtype policy, ``dataset``'s sample shape and training
    size, and the probe's ``options``."""
    layers = [(type(layer).__name__, [list(w.shape) for w in layer.weights])
              for layer in model._flatten_layers(include_self=False)]
    payload = {"layers": layers, "policy": str(model.dtype_policy.name),
               "input": list(dataset.x_train.shape[1:]), "num_train": len(dataset.x_train),
               **options}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def machine_stamp(probe_format: int) -> str:
    """Where and with what a measurement is taken: backend, versions, device and processor,
    and the probe's record format."""
    payload = {**environment_identity(), "format": probe_format}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


# -- the store -------------------------------------------------------------------------------
class MeasurementWarning(UserWarning):
    """A stored per-machine measurement was not used: damaged, from another machine or
    version, or not trusted; it is measured again."""


REPROBE_ENV = "KBACKEND_REPROBE"  # set by ``--reprobe``: stored measurements are taken again
_OFF = ("", "0", "false", "no", "off")
_REPROBED: set[tuple[str, str]] = set()  # (file, key) measured again in this process already


def request_reprobe() -> None:
    """Make this process (and the processes it starts) measure again what it would read from
    the per-machine store (``--reprobe``), each entry once."""
    os.environ[REPROBE_ENV] = "1"


def reprobe_requested() -> bool:
    return os.environ.get(REPROBE_ENV, "0").strip().lower() not in _OFF


def measurement_path(file_name: str) -> Path:
    return cache_dir() / file_name


def stored_measurements(file_name: str) -> dict[str, dict[str, Any]]:
    """The entries of ``<kbackend cache folder>/<file_name>``.

    A file that is not a JSON object is moved aside to ``<file_name>.damaged-<time>`` (the
    backup) with a ``MeasurementWarning`` and read as empty; entries that are not objects, or
    have no stamp (``measured_on``: written before this harness), are dropped with a warning,
    the others kept."""
    path = measurement_path(file_name)
    if not path.is_file():
        return {}
    try:
        loaded = read_json(path)
        if not isinstance(loaded, dict):
            raise StoredFileError("not a JSON object")
    except (OSError, ValueError) as error:
        backup = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
        with contextlib.suppress(OSError):
            os.replace(path, backup)
        warnings.warn(f"{path} is damaged ({error}): kept as {backup.name}, its measurements "
                      "taken again", MeasurementWarning, stacklevel=2)
        return {}
    kept = {key: entry for key, entry in loaded.items()
            if isinstance(entry, dict) and "measured_on" in entry}
    if len(kept) < len(loaded):
        warnings.warn(f"{path}: {len(loaded) - len(kept)} damaged or older entries ignored "
                      f"(the other {len(kept)} kept)", MeasurementWarning, stacklevel=2)
    return kept


def machine_measurement(file_name: str, key: str, measure: Callable[[], dict[str, Any]],
                        stamp: str, distrust: Callable[[dict[str, Any]], str | None] | None = None,
                        ) -> tuple[dict[str, Any], bool]:
    """``measure()``'s result for ``key``, measured once per machine and software and kept in
    ``<kbackend cache folder>/<file_name>`` (a damaged file or entry: ``stored_measurements``);
    returns it and whether it was stored. With the caches off (``KBACKEND_COMPILE_CACHE=0``) it
    measures every time; with ``--reprobe`` each key is measured again once per process.
    ``stamp`` is kept as ``measured_on``: an entry with another stamp is ignored with a
    ``MeasurementWarning`` and measured again; so is one ``distrust(entry)`` gives a reason for."""
    stored = compile_cache_enabled()
    entry = stored_measurements(file_name).get(key) if stored else None
    if entry is not None and not (reprobe_requested() and (file_name, key) not in _REPROBED):
        reason = ("it was measured on another machine or kbackend version"
                  if entry["measured_on"] != stamp
                  else distrust(entry) if distrust is not None else None)
        if reason is None:
            return entry, True
        warnings.warn(f"stored measurement in {file_name} not used ({reason}): measuring "
                      "again", MeasurementWarning, stacklevel=3)
    result = {**measure(), "measured_on": stamp}
    _REPROBED.add((file_name, key))
    if stored:
        # Read again just before writing: entries other processes stored meanwhile are kept. An
        # unwritable cache folder costs a measurement next time, nothing else.
        with contextlib.suppress(OSError):
            atomic_write_json(measurement_path(file_name),
                              {**stored_measurements(file_name), key: result})
    return result, False


@dataclass(frozen=True)
class Probe:
    """A measurement kept per machine: the name ``kbackend info`` lists it under, its file,
    its record format (part of the stamp: a new format is measured again) and the one line
    that says what an entry answers."""

    name: str
    file_name: str
    record_format: int
    describe: Callable[[dict[str, Any]], str]


def remembered(probe: Probe, model: Any, dataset: Any, options: dict[str, Any],
               measure: Callable[[], dict[str, Any]],
               distrust: Callable[[dict[str, Any]], str | None] | None = None) -> dict[str, Any]:
    """``measure()``'s record for this workload (``measurement_key`` of ``model``, ``dataset``
    and ``options``) on this machine, measured once and kept (``machine_measurement``), with
    ``cached`` (whether it was stored) and ``seconds`` (the time it took here) added."""
    start = time.perf_counter()
    key = measurement_key(model, dataset, **options) if compile_cache_enabled() else ""
    entry, cached = machine_measurement(probe.file_name, key, measure,
                                        machine_stamp(probe.record_format), distrust)
    return {**entry, "cached": cached, "seconds": time.perf_counter() - start}


def _describe_knee(entry: dict[str, Any]) -> str:
    answer = entry.get("knee") if entry.get("resolved") else "unresolved (noisy)"
    sizes = entry.get("sizes") or []
    span = f", sizes {sizes[0]}-{sizes[-1]}" if sizes else ""
    return (f"knee {answer}{span}, noisy {'yes' if entry.get('noisy') else 'no'}, "
            f"re-measured {entry.get('remeasured', 0)}")


FUSED_STEPS = Probe("fused steps", "fused_steps_probe.json", 2,
                    lambda entry: f"K={entry.get('fused_steps')}")
KNEE = Probe("throughput knee", "adaptive_knee_probe.json", 2, _describe_knee)
POPULATION = Probe("population", "population_probe.json", 2,
                   lambda entry: f"{entry.get('path')} ({entry.get('members')} members)")
PROBES = (FUSED_STEPS, KNEE, POPULATION)


def stored_probes() -> dict[str, dict[str, str]]:
    """Every stored probe: ``{probe name: {key prefix: its answer}}``; an entry measured on
    another machine or version (measured again before use) says so."""
    listed: dict[str, dict[str, str]] = {}
    for probe in PROBES:
        here = machine_stamp(probe.record_format)
        listed[probe.name] = {
            key[:12]: probe.describe(entry) + ("" if entry["measured_on"] == here
                                               else " (measured elsewhere)")
            for key, entry in stored_measurements(probe.file_name).items()}
    return listed
