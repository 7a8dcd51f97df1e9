"""The data plane, with Monarch's ``monarch.rdma`` API: change the import, keep the code.

from monarch_nb.rdma import RDMABuffer

class ParameterServer(Actor):
    def __init__(self):
        self.weights = torch.rand(1000, 1000)
        self.buffer = RDMABuffer(self.weights.view(torch.uint8).flatten())

    @endpoint
    def get_weights(self) -> RDMABuffer:
        return self.buffer  # a small handle; the bytes move on read_into

weights_ref.read_into(local.view(torch.uint8).flatten()).get()

Same host: a copy out of the owner's shared memory. Across hosts: a direct TCP stream from the
owner's process, authenticated with the cluster key and encrypted. Never through the controller.
"""

from ._buffer import (
    BufferDroppedError,
    RDMAAction,
    RDMABuffer,
    RDMAReadTransferWarning,
    RDMAShmFallbackWarning,
    RDMATcpFallbackWarning,
    RDMAWriteTransferWarning,
    bytes_moved,
    get_rdma_backend,
    is_ibverbs_available,
    is_rdma_available,
)

__all__ = [
    "BufferDroppedError",
    "RDMAAction",
    "RDMABuffer",
    "RDMAReadTransferWarning",
    "RDMAShmFallbackWarning",
    "RDMATcpFallbackWarning",
    "RDMAWriteTransferWarning",
    "bytes_moved",
    "get_rdma_backend",
    "is_ibverbs_available",
    "is_rdma_available",
]
