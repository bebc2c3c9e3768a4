"""A study and a training run of a live keras.Model, logged for TensorBoard (docs/study.md).

    python examples/tensorboard_study.py OUT_DIR [--quick]
    tensorboard --logdir OUT_DIR/tensorboard          # needs: pip install 'kbackend[tensorboard]'

The data is scikit-learn's embedded breast-cancer set (offline), standardized. The study writes
one TensorBoard run per optimizer, batch size, rate and seed (each evaluation's scalars) and the
HParams plugin's experiment (HPARAMS tab: optimizer, batch size and rate against steps and time
to target); `runs.csv` beside its report lists every run for pandas. The recommended cell is then
trained with `tensorboard=` (loss, accuracy, rate and samples/s at each evaluation).
--quick: a tiny grid (what tests/test_examples.py runs).
"""

import argparse
from pathlib import Path

import keras
import numpy as np
from sklearn.datasets import load_breast_cancer

import kbackend


def classifier() -> keras.Model:
    model = keras.Sequential([keras.Input((30,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)], name="cancer")
    model.compile("adam", loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--quick", action="store_true", help="a tiny grid")
    args = parser.parse_args()
    data = load_breast_cancer()
    x = ((data.data - data.data.mean(0)) / data.data.std(0)).astype(np.float32)
    y = data.target.astype(np.float32)
    grid = (dict(optimizers=("sgd", "adam"), batch_sizes=(16, 64), seeds=2, max_seeds=2,
                 lr_grid_size=1, max_steps=300, noise_points=0, step_time_repeats=0,
                 frontier_epochs=0) if args.quick else dict(optimizers=("sgd", "adam")))
    result = kbackend.study(classifier(), x, y, target=0.9, out=args.out / "study",
                            tensorboard=args.out / "tensorboard", progress=not args.quick,
                            **grid)
    best = result.best
    if best is None:
        print("No cell reached the target.")
        return
    print(f"best: {best.optimizer} at batch {best.batch_size}, lr {best.learning_rate:g} "
          f"({best.steps_to_target:.0f} steps)")
    print(f"runs: {result.runs_path}")
    try:
        import pandas

        runs = pandas.read_csv(result.runs_path)
        print(runs.groupby(["optimizer", "batch_size"])["steps_to_target"].median().to_string())
    except ImportError:
        print(result.runs_path.read_text())
    trained = kbackend.train(classifier(), x, y, optimizer=best.optimizer,
                             batch_size=int(best.batch_size), learning_rate=best.learning_rate,
                             epochs=5, progress=False,
                             tensorboard=args.out / "tensorboard" / "best-train")
    print(f"val_accuracy per evaluation: {trained.history.history['val_accuracy']}")


if __name__ == "__main__":
    main()
