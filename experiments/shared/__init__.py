"""What the run wing and the scripts share, with neither hydra nor torch: where the checkout is
and how shared files are written (files, lock), what a run folder is (runs), errors, the
statistics and tables of the figures, the decomposition of what compression adds (and the
pages that quote tables), the panels they read, the network cost model, and the
configs read as plain YAML. Scripts share code through this layer, never through each other."""
