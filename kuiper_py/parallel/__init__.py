"""Tensor and expert parallelism: the communicator interface (comm), NCCL on GPUs (nccl), the per-rank sharding
rules (shard) and the driver that runs a group's ranks as one model (group). See docs/PARALLEL.md."""
