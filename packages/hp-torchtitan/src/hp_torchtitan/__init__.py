"""hp_torchtitan: torchtitan model specs whose parallelize functions use hyperparallel's packages.

Importing this package registers the one CPU stand-in torchtitan 0.3.0 needs
to import without triton (see :mod:`hp_torchtitan.compat`); import it before
``torchtitan.models``.
"""

from hp_torchtitan.__about__ import __version__
from hp_torchtitan.compat import install_triton_stand_in, use_cpu_device

install_triton_stand_in()

from hp_torchtitan.meshes import hp_dense_meshes, hp_dense_root, hp_mesh_from_torch  # noqa: E402
from hp_torchtitan.parallelize import parallelize_decoder  # noqa: E402
from hp_torchtitan.pipeline import pipeline_decoder  # noqa: E402
from hp_torchtitan.spec import SPEC_NAME, hp_llama3_spec  # noqa: E402
from hp_torchtitan.tensor_parallel import apply_tp  # noqa: E402

__all__ = [
    "SPEC_NAME",
    "__version__",
    "apply_tp",
    "hp_dense_meshes",
    "hp_dense_root",
    "hp_llama3_spec",
    "hp_mesh_from_torch",
    "install_triton_stand_in",
    "parallelize_decoder",
    "pipeline_decoder",
    "use_cpu_device",
]
