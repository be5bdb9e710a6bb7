"""Transport setup in Python: what is done once per communicator; the data paths are native.

* :mod:`sparkccl.transport.base`: the hooks every transport implements and the one place
  a transport is chosen (``auto`` -> shm, verbs, tcp).
* :mod:`sparkccl.transport.shm`: the shm transport's setup: map every peer's segments.

* :mod:`sparkccl.transport.tcp`: the tcp transport's setup: listen, publish addresses,
  connect, authenticate, hand the sockets to the native proxy.
* :mod:`sparkccl.transport.verbs`: the RDMA (RoCE / InfiniBand) transport's setup: device
  selection, connection records exchanged through the store, pairing checks, QP bring-up.
* :mod:`sparkccl.transport.check`: the lane check every communicator runs before its first
  collective (one small write and flag over every connection), for every transport.
"""
