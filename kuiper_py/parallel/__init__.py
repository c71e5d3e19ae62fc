"""Tensor and expert parallelism: the communicator interface (comm), NCCL on GPUs (nccl), the per-rank sharding
rules (shard) and the driver that runs a group's ranks as one model (group). See docs/PARALLEL.md."""

# the --tp option's help, shared by generate, chat, bench and serve
TP_HELP = ("Tensor-parallel ranks (1, 2, 4 or 8; MoE experts spread over them). On the CPU the ranks are threads of "
           "this one process: the sharding's test path, not a speed-up; on the GPU one process drives N GPUs over "
           "NCCL.")
