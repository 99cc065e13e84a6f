"""Analyses of a model: `sinklab measure` (measurement), `sinklab trajectory` (trajectories), the model table,
and the probe inputs they measure on. Each takes a `sinklab.targets.Target`."""
