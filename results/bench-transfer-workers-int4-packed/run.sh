#!/bin/bash
# int4 packed at 25% of the bf16 experts' bytes (113 slots), SiDA-h8 learned-belady: one vs two transfer workers, interleaved with bf16 all-resident
source .venv/bin/activate
common="--dtype bfloat16 --sample 0 --new-tokens 24 --prompts 3 --threads 1 --hash-cost off --predictors none,sida8=runs/forecast-base/sida-h8"
for r in 1 2 3; do
  for w in 1 2; do
    prescient bench --model runs/bench-w4 --slot-format packed --transfer-workers $w $common --baselines all_resident \
      --runs sida8:learned-belady@0.8828125,none:lru@0.8828125 --json runs/workers/w$w-r$r.json
  done
  prescient bench --model runs/bench-w16 $common --baselines all_resident --runs none:lru@0.125 --json runs/workers/bf16-r$r.json
done
