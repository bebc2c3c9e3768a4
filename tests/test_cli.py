"""The command line end to end (``kbackend.cli.main`` in this process)."""

from __future__ import annotations

import json

import pytest

from kbackend.history import History


@pytest.mark.slow
def test_train_saves_model_and_history(cli, tmp_path, backend):
    model_path, history_path = tmp_path / "m.keras", tmp_path / "h.json"
    # K = 8 (it divides digits' 40 steps per epoch): the auto probe is test_native_engine's subject
    result = cli("train", "--dataset", "digits", "--epochs", "6", "--batch-size", "32",
                 "--fused-steps", "8", "--save", str(model_path), "--history", str(history_path))
    assert result.returncode == 0, result.stderr
    assert "epoch 6/6" in result.stderr  # per-epoch progress lines
    assert "test_accuracy" in result.stdout
    history = History.load(history_path)
    assert history.best("val_accuracy") >= 0.90
    assert history.env["backend"] == backend and history.config["model"] == "seed_mlp"
    assert json.loads(history_path.read_text())["test"]["test_accuracy"] > 0.85
    assert not list(tmp_path.glob(".*tmp*")), "no temporary files left behind"

    import keras

    from kbackend import data

    model = keras.saving.load_model(model_path)
    ds = data.load("digits", seed=0)
    _, accuracy = model.evaluate(ds.x_test, ds.y_test, verbose=0)
    assert abs(accuracy - history.test["test_accuracy"]) < 1e-5


def test_bad_flag_is_one_line_error(cli):
    result = cli("train", "--epochs", "many")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--epochs" in lines[0], result.stderr


def test_unknown_choice_is_one_line_error(cli):
    result = cli("train", "--optimizer", "lamb")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("words", "hint"), [
    (["--no-progres", "off"], "options start with --"),  # a value for a flag that takes none
    (["comapre"], "did you mean 'compare'?"),
])
def test_a_stray_word_names_the_word_not_the_optional_action(cli, words, hint):
    result = cli("study", *words)
    line = result.stderr.strip()
    assert result.returncode == 2 and "\n" not in line
    assert "unexpected argument" in line and hint in line and "invalid choice" not in line


def test_bad_value_is_one_line_error_not_traceback(cli):
    result = cli("train", "--batch-size", "100000", "--quiet")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "larger than the training split" in result.stderr.strip().splitlines()[-1]


def test_save_path_must_be_keras(cli, tmp_path):
    result = cli("train", "--epochs", "1", "--save", str(tmp_path / "m.h5"))
    assert result.returncode == 2 and ".keras" in result.stderr


def test_help_shows_defaults_but_not_for_on_off_flags(cli):
    result = cli("train", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "--fused-steps K" in text and "(default: 1)" in text
    # a store_false flag has no default to show
    assert "turn off jit_compile (XLA) (default" not in text
    assert ("Keras backend: one of jax, tensorflow (default: $KERAS_BACKEND, else the \"backend\" "
            "of $KERAS_HOME/keras.json or ~/.keras/keras.json, else jax)") in text  # said once


@pytest.mark.slow
def test_a_command_line_builds_only_the_command_it_names():
    import argparse
    import subprocess
    import sys

    from kbackend.cli import build_parser, command_names

    def choices(parser: argparse.ArgumentParser) -> list[str]:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return sorted(action.choices)

    # kbackend/commands/<name>.py registers the command <name>: the rule the shortcut relies on.
    assert choices(build_parser()) == command_names() and "study" in command_names()
    assert choices(build_parser("info")) == ["info"]
    # A fresh process, as a user's: `kbackend info` imports no other command's module.
    code = ("import sys; from kbackend.cli import main; main(['info']); "
            "print(sorted(m for m in sys.modules if m.startswith('kbackend.commands.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['kbackend.commands.info']"


@pytest.mark.parametrize("command", [("train",), ("study",)])
def test_an_integer_flag_beyond_int32_is_one_line_exit_2(cli, command):
    # --epochs 10**20 was accepted and trained until killed (issue 36); every integer flag is
    # bounded where the command line is parsed (kbackend.cli.bound_integer_flags).
    flag = "--epochs" if command == ("train",) else "--seeds"
    result = cli(*command, flag, str(10**20))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"argument {flag}: invalid int value: '100000000000000000000' " \
        "(expected at most 2,147,483,647)" in lines[0], result.stderr
