"""Transport setup that is not specific to one module of the communicator.

* :mod:`sparkccl.transport.verbs`: the RDMA (RoCE / InfiniBand) transport's setup: device
  selection, connection records exchanged through the store, pairing checks, QP bring-up.
* :mod:`sparkccl.transport.check`: the lane check every communicator runs before its first
  collective (one small write and flag over every connection), for every transport.
"""
