"""The hash-building thread on its own (real thread, small hand-written predictors), and its
late tables inside the runtime."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from offload_runtime.engine.hash_builder import HashBuilder, HashBuilderError, HashTable
from offload_runtime.engine.loader import load_offloaded
from predictor import FrequencyPredictor, PredictorMeta
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model, load_tokenizer

L, E = 3, 4


class CountingPredictor:
    """Causal and stateful: for each row, layer l's score of expert e is 1 where e is the
    number of tokens the row has seen (mod E), and the token id is added at expert 0."""

    def __init__(self, delay: float = 0.0, fail_at: int | None = None, gate: threading.Event | None = None):
        self.delay, self.fail_at, self.gate, self.steps = delay, fail_at, gate, 0
        self.entered = threading.Event()  # set when a step begins

    def start(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, dtype=torch.long)

    def step(self, state: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        if self.fail_at is not None and self.steps > self.fail_at:
            raise ValueError("hash function diverged")
        time.sleep(self.delay)
        scores = torch.zeros(len(state), L, E)
        scores[torch.arange(len(state)), :, state % E] = 1.0
        scores[:, :, 0] += token_ids[:, None].float()
        state += 1
        return scores


def builder_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hash-builder"]


def wait_table(builder: HashBuilder, step: int, timeout: float = 10.0) -> HashTable:
    deadline = time.monotonic() + timeout
    while (table := builder.poll(step)) is None:
        assert time.monotonic() < deadline, f"no table for step {step} within {timeout} s"
        time.sleep(0.001)
    return table


def test_one_table_per_forward_with_causal_state_and_padding():
    builder = HashBuilder(CountingPredictor())
    try:
        prompt = torch.tensor([[0, 0, 5], [0, 0, 0]])
        mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # row 0 is left-padded: its first token is left out
        builder.submit(0, prompt, new_sequence=True, attention_mask=mask)
        table = wait_table(builder, 0)
        assert table.step == 0 and table.tokens == 5 and table.scores.shape == (L, E)
        # row 0 counted at positions 1, 2 (seen 1, 2 tokens); row 1 at 0, 1, 2; token 5 adds at expert 0
        assert table.scores[0].tolist() == [1.0 + 5.0, 2.0, 2.0, 0.0]
        for step in (1, 2):  # decode: one token per row, the state goes on
            builder.submit(step, torch.tensor([[0], [0]]), new_sequence=False)
            assert wait_table(builder, step).scores[1].tolist() == [0.0, 0.0, 0.0, 2.0] if step == 1 else \
                [2.0, 0.0, 0.0, 0.0]
        builder.submit(3, torch.tensor([[0], [0]]), new_sequence=True)  # a new sequence restarts the state
        assert wait_table(builder, 3).scores[2].tolist() == [2.0, 0.0, 0.0, 0.0]
        assert builder.poll(4) is None
    finally:
        builder.close()


def test_each_token_stream_keeps_its_own_state():
    """An encoder-decoder's encoder (stream 0) and decoder (stream 1) interleave; each goes on
    from its own last token."""
    builder = HashBuilder(CountingPredictor())
    try:
        builder.submit(0, torch.tensor([[0, 0, 0]]), new_sequence=True, stream=0)  # a prompt of 3
        builder.submit(1, torch.tensor([[0]]), new_sequence=True, stream=1)  # the decoder's start token
        builder.submit(2, torch.tensor([[0]]), new_sequence=False, stream=1)  # its second token
        builder.submit(3, torch.tensor([[0]]), new_sequence=False, stream=0)  # the encoder's fourth
        seen = [wait_table(builder, step).scores[0].argmax().item() for step in range(4)]
        assert seen == [0, 0, 1, 3]  # step 0 sums counts 0, 1, 2 with ties: argmax is the first
        assert wait_table(builder, 0).scores[0].tolist() == [1.0, 1.0, 1.0, 0.0]
    finally:
        builder.close()


def test_slow_predictor_tables_come_late_and_in_order():
    gate = threading.Event()
    builder = HashBuilder(CountingPredictor(gate=gate), keep=8)
    try:
        for step in range(4):  # submitting never waits on the predictor, here stuck at step 0
            builder.submit(step, torch.tensor([[1]]), new_sequence=step == 0)
        assert builder.poll(0) is None  # not ready: the runtime would count the table late
        gate.set()
        assert [wait_table(builder, step).scores[0, 0].item() for step in range(4)] == [2.0, 1.0, 1.0, 1.0]
    finally:
        builder.close()


def test_predictor_error_is_raised_by_every_later_call():
    builder = HashBuilder(CountingPredictor(fail_at=2))
    try:
        builder.submit(0, torch.tensor([[1, 2]]), new_sequence=True)
        wait_table(builder, 0)
        builder.submit(1, torch.tensor([[3]]), new_sequence=False)
        deadline = time.monotonic() + 10
        with pytest.raises(HashBuilderError, match="diverged") as raised:
            while time.monotonic() < deadline:
                builder.poll(1)
                time.sleep(0.001)
        assert isinstance(raised.value.__cause__, ValueError)
        with pytest.raises(HashBuilderError, match="diverged"):
            builder.submit(2, torch.tensor([[4]]), new_sequence=False)
    finally:
        builder.close()  # does not raise again
    assert builder_threads() == []


def test_close_is_idempotent_and_does_not_hang_on_a_stuck_predictor(caplog):
    gate = threading.Event()
    predictor = CountingPredictor(gate=gate)
    builder = HashBuilder(predictor, join_timeout=0.2)
    builder.submit(0, torch.tensor([[1]]), new_sequence=True)
    assert predictor.entered.wait(5)  # the thread is stuck in the predictor
    for _ in range(3):
        builder.submit(1, torch.tensor([[1]]), new_sequence=False)  # queued behind the stuck step
    start = time.monotonic()
    builder.close()
    assert time.monotonic() - start < 2 and "still predicting" in caplog.text
    gate.set()  # the stuck step ends; the queued ones are dropped
    for thread in builder_threads():
        thread.join(5)
    assert builder_threads() == [] and predictor.steps == 1
    builder.close()
    with pytest.raises(HashBuilderError, match="closed"):
        builder.submit(2, torch.tensor([[1]]), new_sequence=False)


class SlowFrequencyPredictor(FrequencyPredictor):
    def step(self, state: None, token_ids: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return super().step(state, token_ids)


def test_runtime_counts_late_tables_and_output_is_unchanged(tiny_moe_dir):
    path = tiny_moe_dir("olmoe")
    plain, layers = load_model(path, dtype=torch.float32)
    fingerprint = fingerprint_model(plain, layers)
    predictor = SlowFrequencyPredictor(torch.ones(fingerprint.n_moe_layers, fingerprint.n_experts),
                                       PredictorMeta("frequency", fingerprint))
    inputs = dict(load_tokenizer(path)("def cache(key, value):", return_tensors="pt"))
    model = load_offloaded(path, prediction_guard=False, predictor=predictor, budget=0.5, hash_thread=True)
    with model.runtime as runtime, torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert torch.equal(out, plain.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False))
    stats = runtime.stats()
    assert stats.forwards == 3 and stats.late_tables >= 1  # the prompt's table takes ~0.3 s
    assert stats.late_tables + stats.tables_on_time == 3


def test_wait_blocks_until_the_table_lands_or_the_timeout():
    gate = threading.Event()
    builder = HashBuilder(CountingPredictor(gate=gate))
    try:
        builder.submit(0, torch.tensor([[1]]), new_sequence=True)
        start = time.monotonic()
        assert builder.wait(0, timeout=0.05) is None and time.monotonic() - start >= 0.04
        threading.Timer(0.05, gate.set).start()
        assert builder.wait(0, timeout=10).step == 0  # woken when it lands, not at the timeout
    finally:
        builder.close()
    assert builder.wait(1, timeout=10) is None  # closed: nothing more lands, no waiting


def test_waiting_for_tables_puts_every_later_layer_on_time_and_output_is_unchanged(tiny_moe_dir):
    """SiDA's rule (`table_wait`): the first MoE layer waits for the forward's table, so the
    layers after it are counted on time; without it a slow predictor's tables are late for all."""
    path = tiny_moe_dir("olmoe")
    plain, layers = load_model(path, dtype=torch.float32)
    fingerprint = fingerprint_model(plain, layers)
    inputs = dict(load_tokenizer(path)("def cache(key, value):", return_tensors="pt"))
    want = plain.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    later_layers = 3 * (len(layers) - 1)  # 3 forwards
    for wait in (0.0, 1.0):  # 1 s: the longest wait an option allows, far beyond a step's 0.03 s
        predictor = SlowFrequencyPredictor(torch.ones(fingerprint.n_moe_layers, fingerprint.n_experts),
                                           PredictorMeta("frequency", fingerprint))
        model = load_offloaded(path, prediction_guard=False, predictor=predictor, budget=0.5, hash_thread=True,
                               table_wait=wait)
        with model.runtime as runtime, torch.inference_mode():
            assert torch.equal(model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False), want)
        stats = runtime.stats()
        assert stats.table_layers_on_time + stats.table_layers_late == later_layers
        if wait:
            assert stats.tables_on_time == 3 and stats.table_layers_on_time == later_layers
            assert stats.table_wait_seconds > 0.03 * 3  # each step sleeps 0.03 s a token
        else:
            assert stats.table_layers_late >= 1 and stats.table_wait_seconds == 0


@pytest.mark.parametrize("threaded", [True, False])
def test_asleep_it_predicts_nothing_and_woken_it_catches_up(threaded):
    """Asleep (the prediction guard paused predictions), submitted forwards are kept and the
    predictor does not run; the first forward after waking gets the table it would have got
    awake throughout, its state having stepped over every token; a stream that starts afresh
    while asleep drops what it kept. Inline (`threaded=False`) the same, with no thread."""
    predictor = CountingPredictor()
    builder = HashBuilder(predictor, threaded=threaded)
    try:
        assert bool(builder_threads()) == threaded
        builder.submit(0, torch.tensor([[0, 0]]), new_sequence=True)
        wait_table(builder, 0)
        builder.sleep(True)
        for step in (1, 2, 3):
            builder.submit(step, torch.tensor([[0]]), new_sequence=False)
        time.sleep(0.05)
        assert predictor.steps == 2 and builder.poll(3) is None
        builder.sleep(False)
        builder.submit(4, torch.tensor([[7]]), new_sequence=False)
        # seen 5 tokens before this one: expert 5 mod 4 = 1; token 7 adds at expert 0
        assert wait_table(builder, 4).scores[0].tolist() == [7.0, 1.0, 0.0, 0.0] and predictor.steps == 6
        builder.sleep(True)
        builder.submit(5, torch.tensor([[0]]), new_sequence=False)
        builder.submit(6, torch.tensor([[0, 0]]), new_sequence=True)  # a new sequence: step 5 is moot
        builder.sleep(False)
        builder.submit(7, torch.tensor([[0]]), new_sequence=False)
        assert wait_table(builder, 7).scores[0].tolist() == [0.0, 0.0, 1.0, 0.0] and predictor.steps == 9
    finally:
        builder.close()


def test_asleep_a_stream_keeps_only_its_last_catch_up_tokens():
    """A long sleep costs nothing when it ends: the woken predictor restarts the stream's state from
    its last `catch_up` tokens instead of stepping over every token it slept through."""
    predictor = CountingPredictor()
    builder = HashBuilder(predictor, threaded=False, catch_up=2)
    builder.submit(0, torch.tensor([[0, 0, 0]]), new_sequence=True)
    builder.sleep(True)
    for step in range(1, 6):
        builder.submit(step, torch.tensor([[0]]), new_sequence=False)
    builder.sleep(False)
    builder.submit(6, torch.tensor([[7]]), new_sequence=False)
    # restarted two tokens back: the new token is the third its state has seen (expert 2); 3 + 2 + 1 steps
    assert builder.poll(6).scores[0].tolist() == [7.0, 0.0, 1.0, 0.0] and predictor.steps == 6


def test_a_new_sequence_after_waking_drops_what_the_last_one_kept():
    """Woken by a new sequence's first forward (the guard judges each prompt afresh), the predictor does
    not step over the tokens the last sequence kept while asleep: the new stream starts from nothing."""
    predictor = CountingPredictor()
    builder = HashBuilder(predictor, threaded=False)
    builder.submit(0, torch.tensor([[0, 0]]), new_sequence=True)
    builder.sleep(True)
    for step in (1, 2, 3):
        builder.submit(step, torch.tensor([[0]]), new_sequence=False)
    builder.sleep(False)
    builder.submit(4, torch.tensor([[7, 0]]), new_sequence=True)
    assert builder.poll(4).scores[0].tolist() == [8.0, 1.0, 0.0, 0.0] and predictor.steps == 2 + 2


def test_inline_a_failure_is_raised_by_the_submit_that_met_it():
    builder = HashBuilder(CountingPredictor(fail_at=2), threaded=False)
    builder.submit(0, torch.tensor([[0, 0]]), new_sequence=True)
    with pytest.raises(HashBuilderError, match="diverged"):
        builder.submit(1, torch.tensor([[0]]), new_sequence=False)
    with pytest.raises(HashBuilderError):
        builder.poll(1)
    builder.close()


class LoadsCodeOnceFrequencyPredictor(FrequencyPredictor):
    """At its first step keeps 40 MB for good (compiled code loaded once, say); each state holds
    16 MB while it lives (the predictor at work)."""

    kept: list = []

    def start(self, batch_size: int):
        return b"\1" * (16 * 2**20)

    def step(self, state, token_ids: torch.Tensor) -> torch.Tensor:
        if not self.kept:
            self.kept.append(b"\1" * (40 * 2**20))
        return super().step(None, token_ids)


def test_the_warm_up_counts_what_the_predictor_holds_at_work_not_what_stays(tiny_moe_dir):
    """What stays after the warm-up is in the footprint the plan measures next: counted there once."""
    from offload_runtime.engine.hash_builder import warm_up

    plain, layers = load_model(tiny_moe_dir("olmoe"), dtype=torch.float32)
    fingerprint = fingerprint_model(plain, layers)
    predictor = LoadsCodeOnceFrequencyPredictor(torch.ones(fingerprint.n_moe_layers, fingerprint.n_experts),
                                                PredictorMeta("frequency", fingerprint))
    at_work = warm_up(predictor, forecasts=False, next_token=False)
    assert predictor.kept and 12 * 2**20 < at_work < 28 * 2**20
