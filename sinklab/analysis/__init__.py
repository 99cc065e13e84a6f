"""Analyses of a model: `sinklab measure` (measurement), `sinklab trajectory` (trajectories), `sinklab atlas` (atlas:
every head's map as one HTML page), the model table, and the probe inputs they measure on. Each takes a
`sinklab.targets.Target`."""
