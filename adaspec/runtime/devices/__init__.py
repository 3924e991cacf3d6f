"""Device backends (cpu, cuda, npu), streams, buckets, kernels, sampler, collectives."""
