"""The Triton kernels, one module per kernels/ module that launches them.

They live apart from their launchers so that `triton` is imported only when a Triton kernel first
runs (on CUDA, or under TRITON_INTERPRET in the kernel tests): importing it maps its compiler
(LLVM, MLIR) into the process, ~75 MB resident, which an engine on the CPU's native kernels and
torch never calls. Each launcher imports its module inside the function that launches.
"""
