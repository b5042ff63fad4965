"""lm-evaluation-harness tasks over the built-in corpora, for measuring a served model's quality
the way the field does (`lm_eval --include_path` this folder; the recipe is in
docs/getting-started.md):

- `prescient_docstrings` (loglikelihood): a docstring paragraph of the standard library's
  validation split, its last words scored given the ones before; perplexity and how often the
  continuation is the greedy one (`acc`).
- `prescient_code` (generate_until): a function's `def` line of the standard library's code,
  completed greedily up to a blank line; exact match with the file's next lines.

Both need no hub: `corpus_tasks` builds their rows from `training.corpora`.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
TASKS = ("prescient_docstrings", "prescient_code")
