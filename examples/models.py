"""Builders for `kbackend --model examples/models.py:NAME` (docs/your-model.md).

Each is a plain Keras builder: kbackend calls it with the arguments it names (`input_shape`,
`num_classes`) and trains the model with its compiled loss and metric.
"""

import keras


def conv1d_classifier(input_shape, num_classes):
    """A sequence classifier: Conv1D + BatchNormalization blocks and global average pooling,
    logits out (the compiled loss says so)."""
    inputs = keras.Input(input_shape)
    x = inputs
    for filters in (32, 64):
        x = keras.layers.Conv1D(filters, 5, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
        x = keras.layers.MaxPooling1D(2)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(num_classes)(x)
    model = keras.Model(inputs, outputs, name="conv1d_classifier")
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def regressor(input_shape):
    """A small MLP regressor (features standardized by make_data.py), trained on MSE and
    reported as MAE; its Dropout is seeded, so runs repeat."""
    model = keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dropout(0.1, seed=1),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(1),
    ], name="regressor")
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def binary_classifier(input_shape):
    """A binary classifier with a logit output: binary cross-entropy from logits."""
    model = keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(1),
    ], name="binary_classifier")
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def text_classifier():
    """keras.io's text classification, raw strings in: TextVectorization first (not adapted
    here: kbackend adapts it on the training split, runs it on the host, and saves this whole
    model, which then takes raw strings), an Embedding, pooling and a sigmoid output."""
    vectorizer = keras.layers.TextVectorization(max_tokens=2000, output_sequence_length=32)
    inputs = keras.Input(shape=(1,), dtype="string")
    x = keras.layers.Embedding(2000, 16)(vectorizer(inputs))
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    outputs = keras.layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model(inputs, outputs, name="text_classifier")
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return model


def two_heads(input_shape):
    """A multi-output model (docs/your-model.md, "Several outputs"): a shared body, a regression
    head `progression` and a 3-class head `risk` (logits), compiled with a loss per output and
    loss weights, as Keras's functional API guide does. Its labels: y_train_progression and
    y_train_risk in the .npz (`make_data.py`'s diabetes_heads.npz)."""
    inputs = keras.Input(input_shape, name="features")
    x = keras.layers.Dense(32, activation="relu")(inputs)
    progression = keras.layers.Dense(1, name="progression")(x)
    risk = keras.layers.Dense(3, name="risk")(x)
    model = keras.Model(inputs, [progression, risk], name="two_heads")
    model.compile(optimizer="adam",
                  loss={"progression": "mse",
                        "risk": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
                  loss_weights={"progression": 0.5, "risk": 1.0},
                  metrics={"progression": ["mae"], "risk": ["accuracy"]})
    return model
