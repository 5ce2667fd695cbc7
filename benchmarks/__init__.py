"""Benchmarks and measurements: step times, the optimiser's overhead, the GPU acceptance check, the shaped network. Each writes its report under results/bench or results/cost."""
