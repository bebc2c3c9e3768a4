"""kbackend: hardware-aware training with Keras 3 on JAX or TensorFlow, measured.

Importing this package does not import Keras: the backend is chosen first
(``kbackend.backend_choice.use_backend``), because Keras reads ``KERAS_BACKEND`` once, at import.
"""

__version__ = "0.1.0"
