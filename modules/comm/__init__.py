"""One communicator interface over a group of global ranks: gloo (CPU) or cupy NCCL (GPU).

    from modules.comm import build_communicators
    comms = build_communicators([[0, 1], [2, 3]], rank=r, backend="gloo")  # on every rank
    comm = comms.get((0, 1))          # keys sorted; None where this rank is not a member
    comm.all_reduce(t); comm.send(t, dst=1); comm.recv(t, src=0); ...

Peers are always global ranks (rank = device id in a plan). See base.Communicator.
"""

from modules.comm.base import CommError, Communicator
from modules.comm.factory import build_communicators
from modules.comm.gloo import GlooCommunicator
from modules.comm.nccl import CupyNcclCommunicator

__all__ = ["CommError", "Communicator", "CupyNcclCommunicator", "GlooCommunicator",
           "build_communicators"]
