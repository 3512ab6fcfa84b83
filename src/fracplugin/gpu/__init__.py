"""GPU inventory: NVML (real) and simulated (YAML node) backends behind one Protocol."""
