"""The engine tests' tiny random checkpoints, shared with the GPU layer."""

from tests.unit.engine.conftest import hf_models, tiny_models  # noqa: F401  (fixtures)
