"""A DeviceMesh with the hybrid scheme of arXiv 2409.02423: compress data-parallel gradients
hard, keep tensor- and pipeline-parallel traffic exact (or light).

`hybrid_mesh` is ``init_device_mesh`` with a ``backend_override`` per dimension: the
data-parallel dimensions (names starting with "dp": "dp", or "dp_replicate" / "dp_shard" as
torchtitan names them) over
"loco" with the given `LocoConfig` (default: the ``LOCO_*`` environment, i.e. 4-bit LoCo on
gradient reductions issued during backward), and every other dimension ("tp", "pp", "cp", ...)
exact over the device's own backend (gloo for CPU, NCCL for CUDA) unless a `LocoConfig` is
given for it. Every rank must call it with the same arguments, after ``init_process_group``.

Error feedback is for gradients: it adds one call's quantization error to the next call with
the same key, which for a data-parallel gradient is the same parameter's gradient one step
later, but for a tensor-parallel activation (or its gradient) another batch's. Compressing a
non-data-parallel dimension with feedback on made the study's loss 75% worse (docs/hybrid.md),
so `hybrid_mesh` warns when such a dimension gets a config with ``feedback=True``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lowbitcc.config import LocoConfig

DATA_PARALLEL_PREFIX = "dp"
"""`hybrid_mesh` treats the dimensions whose names start with it as data parallel ("dp",
"dp_replicate", "dp_shard", ...)."""


def is_data_parallel(name: str) -> bool:
    return name.startswith(DATA_PARALLEL_PREFIX)


def hybrid_mesh(device_type: str, shape: tuple[int, ...],
                mesh_dim_names: tuple[str, ...] = ("dp", "tp"),
                configs: Mapping[str, LocoConfig] | None = None,
                param_bits: int | None = None) -> DeviceMesh:
    """``init_device_mesh(device_type, shape, mesh_dim_names=...)`` with per-dimension backends.

    ``configs`` maps a dimension name to the `LocoConfig` of its groups (those dimensions go
    over "loco"); data-parallel dimensions missing from it get ``LocoConfig.from_env()``, the
    others stay exact on the device's backend. ``param_bits`` (e.g. 8), if given, is set on the
    data-parallel dimensions' configs: FSDP's parameter all-gathers then travel compressed too.
    """
    if len(shape) != len(mesh_dim_names):
        raise ValueError(f"lowbitcc.hybrid_mesh: {len(shape)} sizes for "
                         f"{len(mesh_dim_names)} names {mesh_dim_names}")
    configs = dict(configs or {})
    unknown = set(configs) - set(mesh_dim_names)
    if unknown:
        raise ValueError(f"lowbitcc.hybrid_mesh: configs for {sorted(unknown)}, which are not "
                         f"dimensions of {mesh_dim_names}")
    exact = "nccl" if device_type == "cuda" else "gloo"
    override: dict[str, object] = {}
    for name in mesh_dim_names:
        config = configs.get(name)
        if config is None and is_data_parallel(name):
            config = LocoConfig.from_env()
        if config is not None and param_bits is not None and is_data_parallel(name):
            config = config.replace(param_bits=param_bits)
        if (config is not None and not is_data_parallel(name) and config.wire_feedback
                and config.policy != "never"):
            warnings.warn(f"lowbitcc.hybrid_mesh: dimension {name!r} is not data parallel but "
                          "its LocoConfig keeps error feedback: the error of one batch's "
                          "activations would be added to the next's; use feedback=False "
                          "(docs/hybrid.md)", UserWarning, stacklevel=2)
        override[name] = ("loco", config) if config is not None else exact
    return init_device_mesh(device_type, shape, mesh_dim_names=mesh_dim_names,
                            backend_override=override)
