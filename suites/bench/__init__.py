"""Benchmarks: fused-kernel latency, quantizer encode/decode timings
(pytest-benchmark) and the asv suite (`asv_benchmarks/`) that tracks figures across commits."""
