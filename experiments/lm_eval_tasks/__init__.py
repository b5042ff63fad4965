"""lm-evaluation-harness tasks over the built-in corpora, for measuring a served model's quality
the way the field does (`lm_eval --include_path` this folder; the recipe is in
docs/getting-started.md):

- `prescient_docstrings` (loglikelihood): the 17th word of a docstring paragraph of the standard
  library's validation split, scored given the 16 before it (as LAMBADA scores a passage's last
  word); perplexity and how often the word is the greedy continuation (`acc`).
- `prescient_code` (generate_until): a function's `def` line of the standard library's code,
  completed greedily up to a blank line; exact match with the file's next lines.

Both need no hub: `corpus_tasks` builds their rows from `training.corpora`.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
TASKS = ("prescient_docstrings", "prescient_code")
