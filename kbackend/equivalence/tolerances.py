"""Float32 tolerances per compared quantity and the known divergences between backends: the ONE
place both are stated (docs/equivalence.md gives the reasoning at length).

A pair of arrays ``a`` (reference backend) and ``b`` passes when

    max|a - b| <= atol   or   max|a - b| / max(max|a|, max|b|) <= rtol

i.e. the error is measured relative to the tensor's own scale, not element by element: float32
sums of many terms carry errors proportional to the largest terms, so an element that cancels to
nearly zero is not held to a relative tolerance it cannot meet, and the test means the same for
inputs of magnitude 1e-3 and 1e3. ``atol`` only matters for tensors that are (nearly) all zero.
NaN matches NaN and an infinity matches the same infinity; anything else against NaN/inf fails.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """Pass when the max abs difference <= atol or the scale-relative difference <= rtol."""

    atol: float
    rtol: float
    why: str


# float32 machine epsilon is 1.19e-7. A forward pass of a few layers accumulates a few hundred
# ulps at worst when two libraries order their sums differently (XLA vs Eigen/oneDNN).
TOLERANCES: dict[str, Tolerance] = {
    "forward": Tolerance(1e-6, 1e-5, "inference outputs: a few layers of float32 sums in different "
                         "orders (XLA vs TF/oneDNN kernels), ~100 ulps of the output scale"),
    "loss": Tolerance(1e-6, 1e-5, "a mean over the batch of the forward error"),
    "gradient": Tolerance(1e-6, 1e-4, "backward passes differ more: different reduction orders for "
                          "weight gradients (sums over batch and space) and recurrent chains"),
    "step1": Tolerance(1e-6, 1e-5, "weights after one step: w - lr*update, dominated by w"),
    "stepK": Tolerance(1e-6, 1e-4, "weights after K steps: gradient differences compound, and "
                       "Adam's normalized update amplifies them where sqrt(v) ~ epsilon"),
    "saved": Tolerance(1e-6, 1e-5, "a model saved on one backend and loaded on the other predicts "
                       "with bit-identical weights, so as close as the forward pass"),
    "weights": Tolerance(0.0, 0.0, "saving and loading copies float32 weights exactly"),
    "engine": Tolerance(1e-6, 1e-5, "same backend, same data and initial weights: only fusion and "
                        "compilation boundaries differ"),
}


@dataclass(frozen=True)
class Divergence:
    """A real difference between the backends, recognized by name and handled explicitly."""

    name: str
    what: str
    handling: str
    # A substring of the worker's error message that identifies this divergence (None: the
    # divergence is avoided by construction, never observed as an error).
    error_marker: str | None = None


KNOWN_DIVERGENCES: dict[str, Divergence] = {
    d.name: d for d in (
        Divergence(
            "tf-cpu-channels-first",
            "Documented: TensorFlow's CPU kernels implement convolution and pooling only for "
            "channels_last (keras issues 20414, 19591; kbackend.backends.tensorflow.probes."
            "supports_channels_first_conv probes the installed build). Measured here (Keras 3.15, "
            "TF 2.21): Conv1D/Conv2D and pooling in channels_first run on TF CPU, forward and "
            "backward (TF's convolution accepts NCHW, Keras transposes around pooling; Conv3D "
            "goes through XLA), and agree with JAX.",
            "Each worker probes channels_first at start (runner.channels_first_probe); the "
            "cross-backend channels_first property runs where both probes pass and skips with "
            "the probe's error otherwise. A model that fails on a backend reports the error; "
            "if it names channels_first/NCHW it is labelled with this divergence.",
            error_marker="NCHW",
        ),
        Divergence(
            "stochastic-layers",
            "Dropout (and RNN dropout, GaussianNoise...) draws from each backend's own RNG in "
            "training mode: no two backends produce the same mask.",
            "Forward outputs are compared in inference mode; for loss, gradients and optimizer "
            "steps the workers make such layers inert (rate 0) and the report lists them.",
        ),
        Divergence(
            "seeded-initialization",
            "The same seed gives different initial weights on JAX and TF (different RNGs).",
            "Weights are always copied from one backend to the other, never re-seeded.",
        ),
        Divergence(
            "adam-epsilon",
            "Keras Adam adds epsilon to the uncorrected sqrt(v); optax to the bias-corrected one.",
            "Step comparisons build every optimizer from one OptimizerSpec through "
            "runner.make_optimizer (Keras optimizers on both backends), so both use one "
            "convention.",
        ),
        Divergence(
            "tf-sparse-adam-duplicate-ids",
            "On TF an Embedding's gradient is a sparse tf.IndexedSlices with one slice per "
            "looked-up id, and Keras' Adam squares it slice by slice (keras.ops.square is "
            "sparse-aware) before scatter-adding into v: an id repeated in a batch gets "
            "sum(g_i^2) instead of (sum g_i)^2. JAX's dense gradient gives the latter. Found by "
            "this suite (found with lr 0.1: 0.08 after two steps; 2e-2 relative after one).",
            "Reported by name for the step rows it explains (Adam/AdamW, a sparse gradient, a "
            "repeated id): the step1 rows of the embedding and the stepK rows of that run. "
            "Everything else must still pass. SGD and momentum are linear in the gradient and "
            "agree. To train identically on TF, densify the gradient before the update "
            "(tf.convert_to_tensor), which the JAX side does implicitly.",
        ),
        Divergence(
            "keras-tf-add-bias-heuristic",
            "Found by this suite; a Keras bug on the TF backend. keras.ops.add turns x1 + x2 into "
            "tf.nn.bias_add when x2 squeezes to a vector and guesses the channel axis from shapes "
            "(NHWC whenever x1.shape[-1] equals the vector's length). A channels_first Conv1D/"
            "Conv2D adds its bias as shape (1, C, 1...), so when the output's last spatial size "
            "equals the number of filters TF adds the bias along the wrong axis, silently (any "
            "device). E.g. Conv1D(2, 1, data_format='channels_first') on inputs of shape (1, 2).",
            "The TF worker records the additions that take the wrong branch "
            "(backends/tensorflow/gradients.py, bias_add_misroutes); when a model has any, its "
            "failing rows are labelled with this name and the report lists the shapes. Models "
            "without such an addition must pass. Avoid it by keeping channels_first spatial "
            "sizes != filters, or use channels_last on TF.",
        ),
        Divergence(
            "batchnorm-cancellation",
            "Found by this suite. In training mode BatchNormalization computes x - mean(x) over "
            "the batch; when the batch barely varies (e.g. sigmoid of inputs of size 1e-3: "
            "0.5 +- 2.5e-4) that difference cancels, and the one-ulp differences between the "
            "backends' upstream kernels (6e-8 at 0.5) become relative errors of ulp/std (~2e-4) "
            "in the normalized output, the loss, the gradients and the steps. Inference mode "
            "(moving statistics) is not affected. Ill-conditioning, not a bug of either backend.",
            "The workers measure each BatchNormalization input's spread std/max|x| per channel; "
            "when one is below 1e-2 (where one float32 ulp exceeds 1e-5 of the output) and every "
            "inference-mode row passes, the failing training-mode rows (loss, gradient, steps) "
            "are labelled with this name and the report lists the layers and spreads.",
        ),
        Divergence(
            "unstable-training",
            "Found by this suite. With inputs of size 1e3 and SGD / momentum at lr 0.01 the "
            "loss explodes within K=3 steps; each step multiplies the previous differences by "
            "about lr*|x|^2, so float32 round-off reaches visible size by step K on any two "
            "implementations. Not a backend difference: a diverging run.",
            "Attributed only to stepK rows of an optimizer run whose reference loss grows more "
            "than 100x over the K steps (or stops being finite); the step-1 rows, forward, loss "
            "and gradients must still pass.",
        ),
        Divergence(
            "adam-roundoff-gradient",
            "A gradient that is exactly zero in exact arithmetic (e.g. the offset of a "
            "BatchNormalization followed by another normalization) comes out as float32 round-off "
            "(~1e-9) that differs between backends. Adam divides by the gradient's own running "
            "magnitude, so each backend moves that weight by up to ~learning rate in a direction "
            "set by round-off. Found by this suite (BatchNormalization -> BatchNormalization, "
            "beta: 7e-4 relative after one step).",
            "Attributed by name only for the Adam/AdamW step rows of weights whose gradients "
            "agree in absolute terms (below the gradient atol) but not relatively; SGD and "
            "momentum steps of the same weights must pass, and so must every other row.",
        ),
        Divergence(
            "embedding-out-of-range",
            "An Embedding lookup with an id >= input_dim raises on TF but silently returns "
            "clipped/zero rows on JAX.",
            "Random integer inputs are drawn below the Embedding's input_dim; user inputs with "
            "out-of-range ids fail on TF with the worker's error in the report.",
            error_marker="indices",
        ),
    )
}


def divergence_for_error(message: str) -> Divergence | None:
    """The known divergence a worker error message shows, if any."""
    for divergence in KNOWN_DIVERGENCES.values():
        if divergence.error_marker and divergence.error_marker in message:
            return divergence
    return None
