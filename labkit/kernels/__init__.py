"""Kernels: attention variants, quantizers and quantized matmul."""
