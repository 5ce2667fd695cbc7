"""Analysing results: statistics over seeds, the sweep summary table, the selection of tuned
configs, and the W&B readers and dashboards. Reads run folders; runs nothing."""
