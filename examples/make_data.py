"""Write the example datasets (docs/your-model.md) into a folder, offline.

    python examples/make_data.py OUT_DIR

- `sequences.npz`: 6,000 noisy 1-D sequences of length 64 in 4 classes (the class sets the
  frequency and phase of a wave buried in noise, shifted at random), with x_train / y_train and
  x_test / y_test, generated from a fixed seed.
- `diabetes.csv`: scikit-learn's embedded diabetes data (442 patients, 10 features), the
  target standardized (column `target`), for regression.
- `breast_cancer.npz`: scikit-learn's embedded breast-cancer data (569 samples, 30 features,
  standardized), labels 0/1, for binary classification.
- `reviews/`: a text folder as `keras.utils.text_dataset_from_directory` reads it (`train/` and
  `test/`, each with `neg/` and `pos/` subfolders of .txt files): 800 + 200 short made-up
  reviews whose sentiment words (two of the label's side, one of the other now and then)
  decide the label.
- `diabetes_heads.npz`: the diabetes data for a model with two outputs: `progression` (the
  standardized target) and `risk` (its tertile, 3 classes), as y_train_<output> keys, the last
  42 patients as x_test / y_test_<output>.
"""

import csv
import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_breast_cancer, load_diabetes


def sequences(n: int = 6000, length: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, n)
    t = np.arange(length)
    frequency = np.array([2.0, 3.0, 5.0, 7.0])[labels][:, None]
    shift = rng.uniform(0, 2 * np.pi, (n, 1))
    waves = np.sin(2 * np.pi * frequency * t / length + shift)
    x = waves + rng.normal(0, 1.5, (n, length))
    return x[..., None].astype(np.float32), labels.astype(np.int64)


POSITIVE = ("good", "great", "lovely", "superb", "moving", "funny", "clever", "fine")
NEGATIVE = ("bad", "awful", "dull", "boring", "weak", "silly", "poor", "tedious")
FILLER = ("the", "movie", "film", "plot", "cast", "was", "a", "very", "and", "story", "it",
          "acting", "ending", "quite", "really", "of", "this", "with")


def reviews(out: Path, n: int = 1000, seed: int = 0) -> None:
    """``n`` made-up reviews as .txt files under ``out/{train,test}/{neg,pos}/``."""
    rng = np.random.default_rng(seed)
    for index in range(n):
        label = int(rng.integers(0, 2))
        words = list(rng.choice(FILLER, int(rng.integers(4, 12))))
        mixed = rng.random() < 0.3  # one word of the other side now and then
        sides = [label, label, 1 - label] if mixed else [label, label]
        for side in sides:
            words.insert(int(rng.integers(0, len(words) + 1)),
                         str(rng.choice(POSITIVE if side else NEGATIVE)))
        split = "train" if index < n * 4 // 5 else "test"
        folder = out / split / ("pos" if label else "neg")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index}.txt").write_text(" ".join(words) + ".\n")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    x, y = sequences()
    np.savez(out / "sequences.npz", x_train=x[:5000], y_train=y[:5000], x_test=x[5000:],
             y_test=y[5000:])
    diabetes = load_diabetes()
    target = (diabetes.target - diabetes.target.mean()) / diabetes.target.std()
    features = (diabetes.data - diabetes.data.mean(0)) / diabetes.data.std(0)
    with open(out / "diabetes.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*diabetes.feature_names, "target"])
        writer.writerows([*row, value] for row, value in zip(features, target, strict=True))
    tertiles = np.quantile(target, [1 / 3, 2 / 3])
    risk = np.searchsorted(tertiles, target).astype(np.int64)
    heads = {"x": features.astype(np.float32), "progression": target.astype(np.float32),
             "risk": risk}
    np.savez(out / "diabetes_heads.npz", x_train=heads["x"][:400], x_test=heads["x"][400:],
             **{f"y_{split}_{name}": heads[name][rows] for split, rows in
                (("train", slice(0, 400)), ("test", slice(400, None)))
                for name in ("progression", "risk")})
    cancer = load_breast_cancer()
    data = (cancer.data - cancer.data.mean(0)) / cancer.data.std(0)
    np.savez(out / "breast_cancer.npz", x=data.astype(np.float32), y=cancer.target)
    reviews(out / "reviews")
    print(f"wrote sequences.npz, diabetes.csv, diabetes_heads.npz, breast_cancer.npz, reviews/ "
          f"to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "example-data"))
