"""Distributed state and communication for tensor and pipeline parallelism (torch.distributed:
gloo on the CPU, NCCL on CUDA; a platform may bring its own communicator).

`parallel_state` holds this process's ranks and groups (every getter answers 1 / 0 without
initialization, so single-process code needs no branches); `communicator` wraps the collectives
the layers and the pipeline use.
"""
