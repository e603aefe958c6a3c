"""Data-parallel attention and expert parallelism over torch.distributed, and EPLB."""
