"""`python -m experiments.trace_capped`: `prescient trace` of a model whose experts exceed the memory
cap, run as a user's machine holds it: each trace a fresh process (`run`), the capped ones in a
memory cgroup at the cap (`prescient.capped_run`), beside the whole model's trace uncapped,
interleaved; routing compared column by column, timings summarized (median and spread)."""
