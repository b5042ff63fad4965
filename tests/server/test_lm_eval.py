"""lm-evaluation-harness (`local-completions`) against the real server over a tiny Mixtral with half
its experts offloaded, on the tasks built from the built-in corpora
(`experiments.lm_eval_tasks`): every request's score equals lm-eval's own run of the plain
transformers model (`hf`) in float32 — each loglikelihood to 1e-5, each greedy generation
identical — and so do the task scores. Skipped where lm-eval is not installed
(`pip install 'moe-prescient[eval]'`)."""

from __future__ import annotations

import pytest

from experiments.lm_eval_tasks import TASKS, TASKS_DIR
from tests.server.serving import MODEL

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

LIMIT, TOL = 6, 1e-5
pytestmark = pytest.mark.slow  # two lm-eval runs, ~30 s


def evaluate(model: str, model_args: str) -> dict:
    """lm-eval's results on the two tasks' first LIMIT rows, with every request's responses."""
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), limit=LIMIT,
                                   task_manager=TaskManager(include_path=str(TASKS_DIR)), log_samples=True,
                                   batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)


def responses(results: dict, task: str) -> list:
    return [sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def served_and_plain(tiny_server, tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    served = evaluate("local-completions", f"model={MODEL},base_url={tiny_server.url}/v1/completions,"
                                           f"tokenizer={path},tokenizer_backend=huggingface,max_retries=1")
    plain = evaluate("hf", f"pretrained={path},dtype=float32,device=cpu")
    return served, plain


def test_loglikelihoods_through_the_server_equal_the_plain_models(served_and_plain):
    served, plain = served_and_plain
    got, want = responses(served, "prescient_docstrings"), responses(plain, "prescient_docstrings")
    assert len(got) == len(want) == LIMIT
    for (logprob, greedy), (plain_logprob, plain_greedy) in (
            (g[0], w[0]) for g, w in zip(got, want)):
        assert logprob == pytest.approx(plain_logprob, abs=TOL) and greedy == plain_greedy
    scores, plain_scores = served["results"]["prescient_docstrings"], plain["results"]["prescient_docstrings"]
    assert scores["perplexity,none"] == pytest.approx(plain_scores["perplexity,none"], rel=TOL)
    assert scores["acc,none"] == plain_scores["acc,none"]


def test_greedy_generations_through_the_server_equal_the_plain_models(served_and_plain):
    served, plain = served_and_plain
    got, want = responses(served, "prescient_code"), responses(plain, "prescient_code")
    assert len(got) == LIMIT and got == want
    assert any(text.strip() for (text,) in got)  # something was generated to compare
    assert served["results"]["prescient_code"]["exact_match,none"] == plain["results"]["prescient_code"]["exact_match,none"]
