"""Every subcommand's parse-and-validate phase, driven in-process with generated values for every
flag: each argument list is accepted, or refused with one line and exit status 2, never a
traceback, and nothing is written (issue 14, Tests).

The seam is where each command's work begins: building the model (train), opening a cache or
loading a model (predict, serve, cache; the cheap check of ``--cache`` that creates nothing runs
for real before it), exporting (export), starting processes (launch, equiv's workers), probing
(advise), or joining a multi-process job / creating virtual devices (the runtime's start-up).
Those are replaced by ``ReachedWork``; reaching them means the flags were accepted. ``study``'s
seam is opening its results store (its first write, after every check against the data); ``info``
has no seam (it only reads). Flag values come from each parser's own actions, so a flag added
later is covered without touching this file.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kbackend import data, distributed, model_sources, models
from kbackend.cli import build_parser, main
from kbackend.commands import advise as advise_command
from kbackend.commands import cache as cache_command
from kbackend.commands import equiv as equiv_command
from kbackend.commands import export as export_command
from kbackend.commands import predict as predict_command
from kbackend.commands import serve as serve_command
from kbackend.commands import train as train_command
from kbackend.study import pipeline as study_pipeline


class ReachedWork(Exception):
    """The command got past validation to its first piece of work."""


def _reached(*args, **kwargs):
    raise ReachedWork


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    (base / "existing_dir").mkdir()
    (base / "dir.keras").mkdir()
    (base / "file.txt").write_text("x")
    (base / "empty.keras").write_bytes(b"")
    np.save(base / "x.npy", np.zeros((3, 4), np.float32))
    with zipfile.ZipFile(base / "model.keras", "w") as archive:  # passes the file check only
        archive.writestr("config.json", "{}")
    return base


def _paths(base):
    return [str(base / name) for name in (
        "new.keras", "new.json", "new.npy", "new_dir", "existing_dir", "dir.keras", "file.txt",
        "file.txt/child.keras", "empty.keras", "model.keras", "x.npy", "missing/deeper/out.keras")]


# Values tried for flags without a type (paths, lists, specs, names): valid-looking and broken.
TEXTS = ["", "0", "-1", "2", "1e400", "nan", "inf", "exact", "2,2,exact,0", "64,32", "a,b",
         "*=0", "0=0:1:3", "0=0:1:0", "bogus", "0-9999999999=0,1", "0=0,1; 0=2", "3-1=0",
         "mse", "Loss", "CE", "sparse_categorical_crossentropy", "redis://127.0.0.1:1/0",
         "127.0.0.1:99999", "localhost:1234", "::", "x" * 300]
# Plausible values of text flags that are not paths, by destination, so their checks pass often
# enough for the checks after them to be reached.
PLAUSIBLE_TEXTS = {"loss": ["mse", "sparse_categorical_crossentropy", "CE", "MeanAbsoluteError"],
                   "grid": ["*=0", "0=0:1:3; *=0", "0-3=0,1"], "decimals": ["2", "exact"]}
INTS = st.one_of(st.integers(-3, 70), st.sampled_from([0, 1, 2**31, -(2**63), 10**20]))
FLOATS = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "1e30", "-0.0", "1e-30", "0", "1.5", "-2"]),
    st.floats(-10, 10).map(repr))


def _wild_value(action: argparse.Action, paths: list[str]) -> st.SearchStrategy[str]:
    if action.choices:
        return st.sampled_from([*map(str, action.choices), "not-a-choice"])
    if action.type is int:
        return st.one_of(INTS.map(str), st.sampled_from(["x", "1.5", ""]))
    if action.type is float:
        return st.one_of(FLOATS, st.sampled_from(["x", ""]))
    return st.sampled_from(TEXTS + paths)


def _plausible_value(action: argparse.Action, paths: list[str]) -> st.SearchStrategy[str]:
    if action.choices:
        return st.sampled_from(list(map(str, action.choices)))
    if action.type is int:
        return st.integers(0, 64).map(str)
    if action.type is float:
        return st.sampled_from(["0", "0.1", "0.5", "1e-3", "1", "2.0"])
    if action.dest in PLAUSIBLE_TEXTS:
        return st.sampled_from(PLAUSIBLE_TEXTS[action.dest])
    return st.sampled_from([*paths, "2", "exact", "64,32"])


def _argv(draw, parser: argparse.ArgumentParser, paths: list[str]) -> list[str]:
    """Some of the parser's flags (each with odds of 1 in 4; required ones, and one of each
    required either-or group, nine times in ten), most with plausible values (so that the checks
    after parsing are reached), one in five with a wild one."""
    argv: list[str] = []
    wanted = {id(a) for a in parser._actions if a.required}
    for group in parser._mutually_exclusive_groups:
        if group.required:
            wanted.add(id(draw(st.sampled_from(group._group_actions))))
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "backend"):
            continue
        if id(action) in wanted:
            skip = draw(st.integers(0, 9)) == 0
        else:
            skip = draw(st.integers(0, 3)) != 0
        if skip:
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:
            argv.append(flag)
            continue
        wild = draw(st.integers(0, 4)) == 0
        argv += [flag, draw((_wild_value if wild else _plausible_value)(action, paths))]
    return argv


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> list[str]:
    """Every command the parser runs ("train", "cache warm", "study", "study compare", ...)."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    found = [" ".join(words)] if words and (sub is None or not sub.required) else []
    for name, child in (sub.choices.items() if sub is not None else ()):
        found += _commands(child, (*words, name))
    return found


COMMANDS = _commands(build_parser())


def test_the_fuzz_drives_every_command():
    assert {"train", "predict", "serve", "cache warm", "cache stats", "cache clear", "export",
            "launch", "advise", "equiv", "study", "study compare", "info"} <= set(COMMANDS)


@st.composite
def command_lines(draw, base):
    paths = _paths(base)
    root = build_parser()
    # Every command the parser has (a command added later is driven too); the ones with the
    # most flags more often.
    command = draw(st.sampled_from([*COMMANDS, "train", "train", "study"]))
    words = command.split()
    argv = [*words, *_argv(draw, _subparser(root, *words), paths)]
    if command in ("export", "equiv"):
        argv.insert(len(words), draw(st.sampled_from(paths)))
    if command == "study compare":
        argv += draw(st.lists(st.sampled_from(paths), max_size=2))
    if command == "launch":
        argv += ["--", *_argv(draw, _subparser(root, "train"), paths)]
    return argv


@pytest.fixture
def work_never_starts(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # relative output paths (study --out 2, ...) land here
    real_prepare, real_load = distributed.prepare, data.load

    def prepare(config):
        if config.num_processes > 1 or config.virtual_devices:
            raise ReachedWork  # joining a job or creating devices starts the runtime
        real_prepare(config)

    # The data checks run for real; each dataset is read once.
    loaded = functools.lru_cache(maxsize=32)(lambda name, options: real_load(name,
                                                                             **dict(options)))

    def load(name, **options):
        return loaded(name, tuple(sorted(options.items())))

    def build_model(name, info, options=None):  # its memory check runs, then work would start
        models.check_model_fits(name, info, options or models.ModelOptions())
        raise ReachedWork

    monkeypatch.setattr(distributed, "prepare", prepare)
    monkeypatch.setattr(train_command, "prepare", prepare)
    monkeypatch.setattr(model_sources, "build_model", build_model)
    monkeypatch.setattr(data, "load", load)
    for module in (predict_command, serve_command, cache_command):
        monkeypatch.setattr(module, "open_store", _reached)
        monkeypatch.setattr(module, "load_model", _reached)
    monkeypatch.setattr(export_command, "export_model", _reached)
    monkeypatch.setattr(advise_command, "advise", _reached)
    monkeypatch.setattr(equiv_command, "WorkerPool", _reached)
    monkeypatch.setattr(study_pipeline, "ResultStore", _reached)
    monkeypatch.setattr(subprocess, "Popen", _reached)  # launch starts no process


@settings(max_examples=250, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_every_command_line_is_accepted_or_one_line_exit_2(data, folder, work_never_starts,
                                                          capsys):
    argv = data.draw(command_lines(folder))
    before = sorted(p.name for p in folder.rglob("*"))
    capsys.readouterr()
    try:
        code = main(argv)
    except ReachedWork:
        code = 0
    except SystemExit as exit_:  # argparse: a bad flag or value
        code = exit_.code
    _, err = capsys.readouterr()
    event(f"{argv[0]} {'accepted' if code == 0 else 'refused'}")  # --hypothesis-show-statistics
    if code != 0:
        lines = err.strip().splitlines()
        assert code == 2, (argv, code, err)
        assert len(lines) == 1 and "error:" in lines[0], (argv, err)
    assert "Traceback" not in err
    assert sorted(p.name for p in folder.rglob("*")) == before, argv  # nothing written


# One valid command line per command; ``test_every_flag_takes_a_name_the_system_refuses``
# replaces one flag (or positional) of it at a time.
def _base_argv(folder) -> dict[str, list[str]]:
    model, x = str(folder / "model.keras"), str(folder / "x.npy")
    return {
        "predict": ["--model", model, "--input", x, "--out", str(folder / "new.npy")],
        "serve": ["--model", model, "--port", "0"],
        "cache warm": ["--model", model, "--cache", str(folder / "new.db"), "--grid", "*=0"],
        "cache stats": ["--cache", str(folder / "new.db")],
        "cache clear": ["--cache", str(folder / "new.db")],
        "export": [model, "--out", str(folder / "new_dir")],
        "equiv": [model],
        "launch": ["--", "--epochs", "1"],
    }


def _flag_cases():
    root = build_parser()
    for command in COMMANDS:
        parser = _subparser(root, *command.split())
        for action in parser._actions:
            if action.nargs == 0 or action.dest in ("help", "command") or \
                    isinstance(action, argparse._SubParsersAction) or action.choices:
                continue
            yield pytest.param(command, action.dest, id=f"{command} {action.dest}")


@pytest.mark.parametrize(("command", "dest"), list(_flag_cases()))
def test_every_flag_takes_a_name_the_system_refuses(command, dest, folder, work_never_starts,
                                                   capsys):
    """Each flag and positional of each command, given a 300-character name (longer than a file
    name may be, so every look at it as a path fails with ENAMETOOLONG): accepted, or refused
    with one line and exit status 2; never an OSError traceback."""
    parser = _subparser(build_parser(), *command.split())
    action = next(a for a in parser._actions if a.dest == dest)
    argv = list(_base_argv(folder).get(command, []))
    value = "x" * 300
    if action.option_strings:
        exclusive = {o for group in parser._mutually_exclusive_groups
                     if action in group._group_actions for a in group._group_actions
                     for o in a.option_strings}
        for index in reversed(range(len(argv))):
            if argv[index] in exclusive or argv[index] in action.option_strings:
                del argv[index:index + 2]
        argv = [*(argv[:argv.index("--")] if "--" in argv else argv), action.option_strings[-1],
                value, *(argv[argv.index("--"):] if "--" in argv else [])]
    elif argv and not argv[0].startswith("-"):
        argv[0] = value  # export's and equiv's model
    else:
        argv.append(value)  # study compare's report folders, launch's train arguments
    before = sorted(p.name for p in folder.rglob("*"))
    capsys.readouterr()
    try:
        code = main([*command.split(), *argv])
    except ReachedWork:
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    _, err = capsys.readouterr()
    assert "Traceback" not in err
    if code != 0:
        assert code == 2 and len(err.strip().splitlines()) == 1 and "error:" in err, (argv, err)
    assert sorted(p.name for p in folder.rglob("*")) == before
