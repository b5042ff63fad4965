"""The runtime benchmark, `prescient bench`: `bench.bench_runtime` runs it; the runs and their
grids are in `grid`, a job and its model in `load`, one measurement in its own process in
`measure`, the JSON records and ratios in `records`, the simulator's replay of each run in
`simulated`, the figure in `plot`."""
