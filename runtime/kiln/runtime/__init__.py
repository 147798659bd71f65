"""kiln-runtime: the public types a kernel package describes its kernels with."""

from kiln.runtime.spec import Backend, BenchCase, CudaSource, KernelSpec, Specialization, TritonEntry

__all__ = ["Backend", "BenchCase", "CudaSource", "KernelSpec", "Specialization", "TritonEntry"]
