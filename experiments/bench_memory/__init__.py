"""`prescient bench --memory`: decode tokens/s against a memory cap for the plain transformers
model, the model memory-mapped (`offload_runtime.engine.mapped`) and the offloading runtime (`systems`), each run a
child process (`child`) in a cgroup capped at the size (`cgroup`), measured and summarized by
`orchestrate`, drawn by `plot`."""
