"""The loss names ``kbackend equiv --loss`` accepts, known without importing Keras.

The driver checks ``--loss`` against this table before any worker starts (a worker would only
find a bad name after Keras and TensorFlow have loaded, and report it as a failed comparison).
It is the set of names ``keras.losses.get`` resolves in Keras 3 (a class name, a function name
or an alias), less the base classes ``Loss`` and ``LossFunctionWrapper``, plus ``crossentropy`` /
``ce`` (any case), for which ``model.compile`` picks the binary, sparse or categorical
cross-entropy from the shapes. ``tests/test_equiv_losses.py`` checks the table against
``keras.losses`` on each backend, both ways, so it cannot drift from the installed Keras.
"""

from __future__ import annotations

from typing import Any

from kbackend.errors import ConfigError

# Each Keras loss class, with its function name and aliases: all name the same loss.
LOSS_NAMES: dict[str, tuple[str, ...]] = {
    "KLDivergence": ("kl_divergence", "kld", "KLD"),
    "Poisson": ("poisson",),
    "BinaryCrossentropy": ("binary_crossentropy", "bce", "BCE"),
    "BinaryFocalCrossentropy": ("binary_focal_crossentropy",),
    "CategoricalCrossentropy": ("categorical_crossentropy",),
    "CategoricalFocalCrossentropy": ("categorical_focal_crossentropy",),
    "SparseCategoricalCrossentropy": ("sparse_categorical_crossentropy",),
    "MeanSquaredError": ("mean_squared_error", "mse", "MSE"),
    "MeanAbsoluteError": ("mean_absolute_error", "mae", "MAE"),
    "MeanAbsolutePercentageError": ("mean_absolute_percentage_error", "mape", "MAPE"),
    "MeanSquaredLogarithmicError": ("mean_squared_logarithmic_error", "msle", "MSLE"),
    "CosineSimilarity": ("cosine_similarity",),
    "LogCosh": ("log_cosh",),
    "Huber": ("huber",),
    "Hinge": ("hinge",),
    "SquaredHinge": ("squared_hinge",),
    "CategoricalHinge": ("categorical_hinge",),
    "Dice": ("dice",),
    "Tversky": ("tversky",),
    "Circle": ("circle",),
    "CTC": ("ctc",),
}
# The classes that take ``from_logits`` (``--from-logits``).
FROM_LOGITS = frozenset({"BinaryCrossentropy", "BinaryFocalCrossentropy", "CategoricalCrossentropy",
                         "CategoricalFocalCrossentropy", "SparseCategoricalCrossentropy"})
# Names ``model.compile`` resolves from the shapes, compared without case.
SHAPE_CHOSEN = ("crossentropy", "ce")

LOSS_CLASS: dict[str, str] = {name: cls for cls, names in LOSS_NAMES.items()
                              for name in (cls, *names)}


def check_loss(name: str, *, from_logits: bool = False, flag: str = "--loss") -> Any:
    """The loss identifier a worker compiles with for ``name``, or a one-line ``ConfigError``.

    Without ``from_logits`` that is ``name`` itself; with it, the serialized class with
    ``from_logits`` on (only the cross-entropy classes take it).
    """
    if not isinstance(name, str) or not (name in LOSS_CLASS or name.lower() in SHAPE_CHOSEN):
        raise ConfigError(f"Invalid {flag}. Expected a Keras loss name: a class "
                          f"({', '.join(LOSS_NAMES)}), its function name (e.g. "
                          "mean_squared_error), an alias (mse, mae, mape, msle, bce, kld) or "
                          f"crossentropy. Received: {name!r}.")
    if not from_logits:
        return name
    cls = LOSS_CLASS.get(name)
    if cls not in FROM_LOGITS:
        raise ConfigError(f"Invalid {flag} with --from-logits. Expected a cross-entropy loss that "
                          "takes logits: one of "
                          f"{', '.join(sorted(LOSS_NAMES[c][0] for c in FROM_LOGITS))} (or its "
                          f"class name, or bce). Received: {name!r}.")
    return {"class_name": cls, "config": {"from_logits": True}}
