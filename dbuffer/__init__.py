"""dbuffer: many tensors in one flat buffer, placed on a DeviceMesh with torch's placements.

The layout math (:mod:`dbuffer.layout`, :mod:`dbuffer.placements`) is pure; the buffer
(:class:`DBuffer`) owns all communication, through :mod:`dbuffer.collectives`.

Importing it wraps two private functions of torch's full-state-dict loaders so that they load
dbuffer's DTensors (whose pieces are not ``torch.chunk``'s) exactly; every other tensor goes to
torch's code unchanged (:mod:`dbuffer.full_load` says why and how).

It needs torch 2.11 or newer: an older torch raises ``ImportError`` here, naming the version
(:mod:`dbuffer.torch_version`).

Importing it also registers :func:`dbuffer.teardown.exit_guard` with ``atexit``, so that a process
that leaves ``torch.distributed`` without :func:`dbuffer.teardown.shutdown` (a framework's script)
does not abort at interpreter exit.
"""

from dbuffer.torch_version import check as _check_torch_version

_check_torch_version()  # before anything that would fail on an old torch with a less clear error

from dbuffer.buffer import DBuffer, distribute_tensors
from dbuffer.calls import CallLabel, CollectiveError
from dbuffer.collectives import Pending, mesh_device
from dbuffer.element_sharded import ElementShardedDTensor
from dbuffer.full_load import install as _install_full_load
from dbuffer.row_sharded import RowShardedDTensor
from dbuffer.layout import (
    Layout,
    OwnedLayout,
    RaggedLayout,
    assign_owners,
    choose_layout,
    compute_layout,
    compute_owned_layout,
    compute_ragged_layout,
)
from dbuffer.placements import Owned
from dbuffer.steps import PreparedRedistribute, PreparedSlot
from dbuffer.view import dtensor_view

_install_full_load()

import atexit as _atexit  # noqa: E402

from dbuffer.teardown import exit_guard as _exit_guard  # noqa: E402

_atexit.register(_exit_guard)  # a framework's exit, without dbuffer.teardown.shutdown: see there

__all__ = [
    "CallLabel",
    "CollectiveError",
    "DBuffer",
    "ElementShardedDTensor",
    "Layout",
    "Owned",
    "OwnedLayout",
    "Pending",
    "PreparedRedistribute",
    "PreparedSlot",
    "RaggedLayout",
    "RowShardedDTensor",
    "assign_owners",
    "choose_layout",
    "compute_layout",
    "compute_owned_layout",
    "compute_ragged_layout",
    "distribute_tensors",
    "dtensor_view",
    "mesh_device",
]
