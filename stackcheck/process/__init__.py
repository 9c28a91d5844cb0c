"""Process machinery both sides use: warm processes, isolation between cells, GPU waiting, the CUDA driver."""
