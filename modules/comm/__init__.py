"""The runtime's one communication layer: a `Communicator` over a group of global ranks, with
gloo (CPU; CUDA tensors staged through host memory) and cupy NCCL (GPU) behind it.

    from modules.comm import build_communicators
    comms = build_communicators([[0, 1], [2, 3]], rank=r, backend="gloo")  # on every rank
    comm = comms.get((0, 1))          # keys sorted; None where this rank is not a member
    comm.all_reduce(t); comm.send(t, dst=1); comm.recv(t, src=0); comm.mean_all_reduce(t, "int8")

Peers are always global ranks (in the runtime: the plan's device ids). Every wait is bounded by
the communicator's timeout (NCCL's by a watchdog that aborts it); failures are `CommError` (a
`PeerError`) naming the operation and the peer(s). Which backend a group gets: choice.py.
See base.Communicator.
"""

from modules.comm.base import CommStats, Communicator, Posted, agree_int, agree_range
from modules.comm.choice import BackendChoice, CommOptions, DeviceInfo, choose_backend
from modules.comm.errors import CommError, PeerError
from modules.comm.factory import as_communicator, build_communicators, compressed_all_reduce_mean
from modules.comm.gloo import GlooCommunicator
from modules.comm.nccl import CupyNcclCommunicator

__all__ = ["BackendChoice", "CommError", "CommOptions", "CommStats", "Communicator",
           "CupyNcclCommunicator", "DeviceInfo", "GlooCommunicator", "PeerError", "Posted",
           "agree_int", "agree_range", "as_communicator", "build_communicators", "choose_backend",
           "compressed_all_reduce_mean"]
