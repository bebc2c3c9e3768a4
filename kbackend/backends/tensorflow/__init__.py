"""The tensorflow backend: every member of ``kbackend.backends.BackendOps``, from its modules.

Same module names in ``backends/jax`` and ``backends/tensorflow``: ``ops`` (devices, processes,
memory, transfers), ``native`` (the fused single-device trainer), ``population`` (a cell's
runs vmapped), ``data_parallel``, ``gradients``, ``probes`` (what the installation supports),
``reference`` (a hand-written loop that benchmarks compare the engines with). Reached only
through ``kbackend.backends.impl()``.
"""

from kbackend.backends.tensorflow.data_parallel import (
    DataParallelTrainer,
    data_parallel_clone_layer,
    data_parallel_jit_compile,
    data_parallel_scope,
    keras_fit_inputs,
)
from kbackend.backends.tensorflow.gradients import bias_add_misroutes, gradients
from kbackend.backends.tensorflow.native import NativeTrainer, native_loop_uses_xla
from kbackend.backends.tensorflow.ops import (
    block_until_ready,
    compilation_counter,
    device_count,
    device_memory_in_use,
    device_scope,
    devices,
    framework_versions,
    initialize_processes,
    local_device_count,
    platform,
    process_count,
    process_index,
    set_random_seed,
    setup_virtual_devices,
    start,
    to_device,
    to_numpy,
)
from kbackend.backends.tensorflow.population import PopulationTrainer
from kbackend.backends.tensorflow.probes import (
    matmul_flops,
    precision_support,
    supports_channels_first_conv,
    supports_populations,
    train_step_memory,
)
from kbackend.backends.tensorflow.reference import reference_conv1d_loop, reference_train_loop
from kbackend.logs import hide_own_retracing_warnings

hide_own_retracing_warnings()

# The Protocol's names for the two trainer factories.
native_trainer = NativeTrainer
data_parallel_trainer = DataParallelTrainer
population_trainer = PopulationTrainer

__all__ = [
    "bias_add_misroutes",
    "block_until_ready",
    "compilation_counter",
    "data_parallel_clone_layer",
    "data_parallel_jit_compile",
    "data_parallel_scope",
    "data_parallel_trainer",
    "device_count",
    "device_memory_in_use",
    "device_scope",
    "devices",
    "framework_versions",
    "gradients",
    "initialize_processes",
    "keras_fit_inputs",
    "local_device_count",
    "matmul_flops",
    "native_loop_uses_xla",
    "native_trainer",
    "platform",
    "population_trainer",
    "precision_support",
    "process_count",
    "process_index",
    "reference_conv1d_loop",
    "reference_train_loop",
    "set_random_seed",
    "setup_virtual_devices",
    "start",
    "supports_channels_first_conv",
    "supports_populations",
    "to_device",
    "to_numpy",
    "train_step_memory",
]
