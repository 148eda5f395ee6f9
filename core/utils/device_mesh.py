"""``submesh``: a sub-mesh of a device mesh by dimension names, flattened dimensions included
(kwplug's own; Accelerate has no such module).

Accelerate's meshes carry flattened dimensions (``dp``, ``dp_shard_cp``, ``dp_cp``, made with
``DeviceMesh._flatten``) that its code and kwplug's read by slicing the root mesh:
``mesh["dp"]``. torch 2.11+ warns on every such slice ("Slicing a flattened dim from root mesh
will be deprecated [...] bookkeep the flattened mesh directly"). Where torch keeps that
bookkeeping on the root mesh (``_flatten_mapping`` in torch 2.13: the very object
``_flatten`` returned), a single flattened name is read from there, without the slice. A slice
mixing a flattened dimension with others has no such replacement, and a torch without that
bookkeeping has nothing to read: there the slice stays, with that one warning filtered by its
message -- torch's replacement, keeping what ``_flatten`` returned, cannot reach these
callers, because the mesh crosses the plugin boundary as a plain ``DeviceMesh`` (the
``device_mesh`` hook), and the deprecation is torch's, not the user's to act on.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The start of torch's message for slicing a flattened dimension (torch/distributed/
#: device_mesh.py, ``_get_slice_mesh_layout``); filtered only around kwplug's own slices.
FLATTENED_SLICE_WARNING = r"Slicing a flattened dim from root mesh"


def submesh(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """``mesh[names]``, without torch's deprecation warning for a flattened dimension.

    Args:
        mesh: the root mesh (``accelerator.torch_device_mesh``).
        names: one or more dimension names, real or flattened.

    Returns:
        The sub-mesh; for one flattened name, the mesh ``_flatten`` made where torch keeps it.

    Raises:
        KeyError, RuntimeError, ValueError: as ``mesh[names]`` (an unknown name).
    """
    bookkept: Any = getattr(mesh, "_flatten_mapping", None)
    if len(names) == 1 and isinstance(bookkept, dict) and names[0] in bookkept:
        flat: DeviceMesh = bookkept[names[0]]
        return flat
    key: str | tuple[str, ...] = names[0] if len(names) == 1 else names
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FLATTENED_SLICE_WARNING, category=UserWarning)
        return mesh[key]
