"""Bad input through the real `prescient` command line: one table, one test. Every row must end
with exit code 2 and one `error:` line naming the bad thing and what to do, no traceback, no
output file written or replaced, and every input file as it was. Then what an output path may be:
a symlink is written through, a character device written in place, a FIFO or a directory refused
before any work. (Writes that fail part-way, on a full disk, are in test_write_failures.)"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from cli.main import main
from offload_runtime.compression.writer import quantize_model
from predictor import SiDAPredictor, SiDASizes
from predictor.artifact import save_predictor
from predictor.base import PredictorMeta
from predictor.sida import SiDAHash, read_token_embeddings
from prescient.fingerprint import fingerprint_model_dir
from prescient.traces import load_trace
from prescient.arch_zoo import save_tiny_model
from tests.conftest import tiny_test_config
from tests.predictor.probes import random_probe
from training.tracing import trace_model

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/predictor/sida.yaml")
PROBE_CONFIG = str(ROOT / "configs/predictor/probe.yaml")
TRACE = {"split": "train", "max_tokens": 60, "top_t": 4, "seq_len": 16, "batch_size": 4, "shard_sequences": 2}


def damaged_trace(source: Path, into: Path, column: str, value: float) -> Path:
    """A copy of a trace with `value` written into `column` of its first shard; the manifest's
    SHA-256 is updated, as a buggy writer would leave it, so only the value checks can catch it."""
    copy = into / f"trace-{column}"
    copy.mkdir()
    manifest = json.loads((source / "manifest.json").read_text())
    for shard in manifest["shards"]:
        (copy / shard["file"]).write_bytes((source / shard["file"]).read_bytes())
    first = copy / manifest["shards"][0]["file"]
    data = load_file(str(first))
    data[column].view(-1)[3] = value
    save_file(data, str(first))
    manifest["shards"][0]["sha256"] = hashlib.sha256(first.read_bytes()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def sida_artifact(model: Path, out: Path) -> Path:
    fingerprint = fingerprint_model_dir(model)
    sizes = SiDASizes(compress_dim=8, hidden_dim=16, attn_window=8)
    torch.manual_seed(0)
    hash_fn = SiDAHash.from_embedding(read_token_embeddings(model), fingerprint.n_moe_layers,
                                      fingerprint.n_experts, sizes)
    return save_predictor(SiDAPredictor(hash_fn, PredictorMeta("sida", fingerprint, dataclasses.asdict(sizes))), out)


BAD_RECIPES = {  # name -> (section, field, value) changed in the tiny recipe
    "recipe_heads": ("model", "num_attention_heads", 5),
    "recipe_top_k": ("model", "num_experts_per_tok", 17),
    "recipe_no_steps": ("training", "max_steps", 0),
    "recipe_lr_text": ("training", "lr", "fast"),
}


def compressed_copies(model: Path, tmp: Path) -> dict[str, Path]:
    """The model quantised to int4, and copies damaged as a bad download or a foreign tool leaves them."""
    good = tmp / "int4"
    quantize_model(model, good, 4)
    paths = {"int4": good}
    scale = "model.layers.0.block_sparse_moe.experts.1.w2.weight_scale"
    for name, change in {"int4_nan": lambda t: t[scale].view(-1).__setitem__(0, float("nan")),
                         "int4_scale_shape": lambda t: t.__setitem__(scale, t[scale][:16].contiguous())}.items():
        shutil.copytree(good, tmp / name)
        tensors = load_file(str(good / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(tmp / name / "model.safetensors"), metadata={"format": "pt"})
        paths[name] = tmp / name
    shutil.copytree(good, tmp / "int4_w4a8")
    config = json.loads((good / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    (tmp / "int4_w4a8" / "config.json").write_text(json.dumps(config))
    shutil.copytree(good, tmp / "int4_no_shard")
    keys = list(load_file(str(good / "model.safetensors")))
    weight_map = {key: "model-00001-of-00002.safetensors" if i % 2 else "model-00002-of-00002.safetensors"
                  for i, key in enumerate(keys)}
    (tmp / "int4_no_shard" / "model.safetensors").rename(tmp / "int4_no_shard" / "model-00001-of-00002.safetensors")
    (tmp / "int4_no_shard" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {**paths, "int4_w4a8": tmp / "int4_w4a8", "int4_no_shard": tmp / "int4_no_shard"}


class Unsafe:
    def __reduce__(self):
        return print, ("this must never run",)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_moe_dir, tiny_tokenizer, text_corpus) -> dict[str, Path]:
    """Every input a row names: good ones, and damaged copies."""
    tmp = tmp_path_factory.mktemp("bad-input")
    model = tiny_moe_dir("mixtral")
    paths = {"model": model, "tmp": tmp}
    paths["other"] = save_tiny_model(tiny_test_config("mixtral", tiny_tokenizer), tmp / "other-model", seed=1,
                                     tokenizer=tiny_tokenizer)
    paths["trace"] = trace_model(model, f"json:{text_corpus}", tmp / "trace", **TRACE)
    paths["trace_ids"] = damaged_trace(paths["trace"], tmp, "topk_ids", 99)
    paths["trace_nan"] = damaged_trace(paths["trace"], tmp, "topt_logits", float("nan"))
    paths["sida"] = sida_artifact(model, tmp / "sida").with_suffix("")
    meta = json.loads(paths["sida"].with_suffix(".json").read_text())
    meta["hparams"]["hidden_dim"] = 32
    (tmp / "sida-hparams.safetensors").write_bytes(paths["sida"].with_suffix(".safetensors").read_bytes())
    (tmp / "sida-hparams.json").write_text(json.dumps(meta))
    paths["sida_hparams"] = tmp / "sida-hparams"
    (tmp / "sida-torn.safetensors").write_bytes(paths["sida"].with_suffix(".safetensors").read_bytes())
    (tmp / "sida-torn.json").write_text(paths["sida"].with_suffix(".json").read_text()[:100])
    paths["sida_torn"] = tmp / "sida-torn"
    for name in ("empty", "no_config", "bad_config", "list_config", "typed_config", "reference", "a_dir"):
        (tmp / name).mkdir()
        paths[name] = tmp / name
    (tmp / "no_config" / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    for file in model.iterdir():
        (tmp / "bad_config" / file.name).write_bytes(file.read_bytes())
    (tmp / "bad_config" / "config.json").write_text('{"model_type": "mixtral", ')
    for file in model.iterdir():
        (tmp / "list_config" / file.name).write_bytes(file.read_bytes())
    (tmp / "list_config" / "config.json").write_text('["mixtral"]')
    for file in model.iterdir():
        (tmp / "typed_config" / file.name).write_bytes(file.read_bytes())
    config = json.loads((model / "config.json").read_text())
    (tmp / "typed_config" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "two"}))
    (tmp / "reference" / "reference.json").write_text('{"recipe": {"tokenizer": ')
    (tmp / "a_file").write_text("mine\n")
    paths["a_file"] = tmp / "a_file"
    os.mkfifo(tmp / "a_fifo")
    paths["a_fifo"] = tmp / "a_fifo"
    for name, (section, field, value) in BAD_RECIPES.items():
        spec = yaml.safe_load((ROOT / "configs/reference/tiny.yaml").read_text())
        spec[section][field] = value
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        paths[name] = tmp / f"{name}.yaml"
    paths.update(compressed_copies(model, tmp))
    torch.save({"state_dict": {}, "hook": Unsafe()}, tmp / "unsafe.ckpt")
    (tmp / "truncated.ckpt").write_bytes((tmp / "unsafe.ckpt").read_bytes()[:200])
    paths.update(unsafe_ckpt=tmp / "unsafe.ckpt", truncated_ckpt=tmp / "truncated.ckpt")
    paths["probe_other"] = random_probe(paths["other"], tmp / "probe-other").with_suffix("")
    return paths


def train(*extra: str) -> list[str]:
    return ["train", "--config", CONFIG, "--data.trace_dir", "{trace}", "--trainer.logger", "false",
            "--trainer.default_root_dir", "{run}", "--trainer.enable_progress_bar", "false",
            "--model.sizes.compress_dim", "8", "--model.sizes.hidden_dim", "16", "--export", "{out}", *extra]


def generate(*extra: str) -> list[str]:
    return ["generate", "--model", "{model}", "--prompt", "def f(x):", "--max-new-tokens", "2", "--json", "{out}",
            *extra]


def trace(*extra: str) -> list[str]:
    return ["trace", "--model", "{model}", "--dataset", "json:{corpus}", "--split", "train", "--max-tokens", "40",
            "--out", "{out}", *extra]


def evaluate(*extra: str) -> list[str]:
    return ["evaluate", "--trace", "{trace}", "--predictors", "freq", "--batch-sizes", "1", "--json", "{out}", *extra]


def compare(*extra: str) -> list[str]:
    return ["compare-caches", "--trace", "{trace}", "--policies", "lru,mrs", "--capacity", "0.5", "--batch-size", "1",
            "--json", "{out}", *extra]


def without(args: list[str], option: str) -> list[str]:
    i = args.index(option)
    return args[:i] + args[i + 2:]


LONG_PROMPT = "def f(x): return x\n" * 200
NO_FILES = "/proc/prescient-out"  # procfs: a folder that cannot hold new files (as root too)
CANNOT_HOLD = r"(cannot write /proc/prescient-out: No such file or directory|folder /proc is not writable)"

# id, argv, what the error line must say (a regex over the line after "error: ")
CASES = [
    ("generate: missing model dir", [*without(generate(), "--model"), "--model", "{tmp}/nowhere"],
     r"model directory .*nowhere does not exist; give"),
    ("generate: empty model dir", [*without(generate(), "--model"), "--model", "{empty}"],
     r"empty has no config.json; expected a Hugging Face model directory"),
    ("generate: dir without config.json", [*without(generate(), "--model"), "--model", "{no_config}"],
     r"no_config has no config.json"),
    ("generate: corrupt config.json", [*without(generate(), "--model"), "--model", "{bad_config}"],
     r"bad_config/config.json is not valid JSON .*; restore"),
    ("generate: config.json not an object", [*without(generate(), "--model"), "--model", "{list_config}"],
     r"list_config/config.json holds a JSON list, not an object of settings; restore"),
    ("generate: a config.json field of the wrong type", [*without(generate(), "--model"), "--model", "{typed_config}"],
     r"typed_config/config.json: Validation error for field 'num_hidden_layers': .*expected int, got str .*; "
     r"correct the field"),
    ("generate: unknown policy", generate("--policy", "bogus"), r"--policy: unknown cache policy 'bogus'; known"),
    ("generate: belady cannot serve", generate("--policy", "belady"), r"'belady' cannot serve: .*serving policies"),
    ("generate: static cannot serve", generate("--policy", "static"), r"'static' cannot serve: .*serving policies"),
    ("generate: no new tokens", [*without(generate(), "--max-new-tokens"), "--max-new-tokens", "0"],
     r"--max-new-tokens: 0 must be at least 1 \(see"),
    ("generate: negative new tokens", [*without(generate(), "--max-new-tokens"), "--max-new-tokens", "-5"],
     r"--max-new-tokens: -5 must be at least 1"),
    ("generate: empty prompt", [*without(generate(), "--prompt"), "--prompt", ""],
     r"the prompt is empty \(0 tokens\); give --prompt some text"),
    ("generate: prompt beyond the context", [*without(generate(), "--prompt"), "--prompt", LONG_PROMPT],
     r"the prompt is \d+ tokens .* beyond the model's context of 256 tokens; shorten"),
    ("generate: unknown device", generate("--device", "bogus"), r"--device: device 'bogus' is not a device name; use"),
    ("generate: unknown expert kernel", generate("--expert-kernel", "cutlass"), r"--expert-kernel.*'cutlass'"),
    ("generate: predictor hparams disagree with its tensors", generate("--predictor", "{sida_hparams}"),
     r"hyper-parameters in .*sida-hparams.json do not fit the tensors in .*sida-hparams.safetensors .*export"),
    ("generate: predictor JSON cut short", generate("--predictor", "{sida_torn}"),
     r"sida-torn.json is not valid JSON .*; export the predictor again"),
    ("generate: --json is a directory", [*without(generate(), "--json"), "--json", "{a_dir}"],
     r"--json: output .*a_dir is a directory, not a file; name a file"),
    ("generate: cross-token prefetch without a predictor", generate("--next-token"),
     r"cross-token prefetch needs a predictor's forecasts: pass a predictor with forecast heads"),
    ("generate: cross-token prefetch with a predictor without forecast heads",
     generate("--predictor", "{sida}", "--next-token"), r"--model.horizon"),
    ("generate: next-token chance above 1", generate("--next-token", "--next-min-chance", "1.5"),
     r"--next-min-chance: 1.5 is not a chance in \[0, 1\]"),
    ("generate: next-token chance above 1, by its name", generate("--next-token", "--next-token-min-chance", "1.5"),
     r"--next-token-min-chance.*: 1.5 is not a chance in \[0, 1\]"),
    ("generate: next-token chance not a number", generate("--next-token", "--next-token-min-chance", "often"),
     r"--next-token-min-chance.*: 'often' is not a number"),
    ("generate: no transfer workers", generate("--transfer-workers", "0"), r"--transfer-workers: 0 must be at least 1"),
    ("generate: more transfer workers than reads in flight", generate("--transfer-workers", "65"),
     r"--transfer-workers: 65 is out of range: give 1 to 64 copies in flight, or auto"),
    ("generate: transfer workers auto without a profile", generate("--transfer-workers", "auto"),
     r"--transfer-workers auto takes the queue depth from a hardware profile: give --link-profile"),
    ("generate: transfer workers auto from a profile without a random-read curve",
     generate("--transfer-workers", "auto", "--link-profile", "t4"), r"hardware profile t4 has no random-read curve"),
    ("profile-hw: queue depth 0", ["profile-hw", "--depths", "0,2", "--json", "{out}"],
     r"--depths: 0 must be at least 1"),
    ("profile-hw: queue depth beyond the runtime's", ["profile-hw", "--depths", "1,128", "--json", "{out}"],
     r"--depths: queue depth 128 is out of range: give 1 to 64"),
    ("generate: lookahead beyond three layers", generate("--lookahead", "4"),
     r"--lookahead: 4 is not a number of layers in 0\.\.3"),
    ("bench: an unknown run mode", ["bench", "--model", "{model}", "--runs", "none:lru@0.5+fast", "--json", "{out}"],
     r"run modes are \+hide \+next \+look \+serial"),
    ("generate: budget without a unit", generate("--budget", "48"), r"--budget: budget '48' names no unit"),
    ("generate: unknown store", generate("--store", "tape"), r"--store: invalid choice: 'tape'"),
    ("generate: a compute dtype the runtime does not run", generate("--dtype", "float16"),
     r"--dtype: invalid choice: 'float16' \(choose from 'float32', 'bfloat16'\)"),
    ("serve: no transfer workers", ["serve", "--model", "{model}", "--transfer-workers", "0"],
     r"--transfer-workers: 0 must be at least 1"),
    ("serve: port out of range", ["serve", "--model", "{model}", "--port", "70000"],
     r"--port: 70000 is not a port in 0..65535"),
    ("serve: negative shutdown timeout", ["serve", "--model", "{model}", "--shutdown-timeout", "-1"],
     r"--shutdown-timeout: -1.0 is not a duration"),
    ("serve: an API key with a space", ["serve", "--model", "{model}", "--api-key", "sk one"],
     r"--api-key: key 1 of 1 is empty, or holds a space .*; give keys of printable ASCII \(from --api-key or "
     r"PRESCIENT_API_KEY\)"),
    ("serve: an empty key in the list", ["serve", "--model", "{model}", "--api-key", "sk-one,"],
     r"--api-key: key 2 of 2 is empty"),
    ("serve: a TLS key without its certificate", ["serve", "--model", "{model}", "--ssl-keyfile", "{a_file}"],
     r"HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    ("serve: a TLS certificate that is not one", ["serve", "--model", "{model}", "--ssl-keyfile", "{a_file}",
                                                   "--ssl-certfile", "{a_file}"],
     r"cannot use the TLS key .*a_file with the certificate .*a_file: .*; give a PEM key and the PEM certificate"),
    ("serve: a prefix cache above the memory", ["serve", "--model", "{model}", "--memory", "1GiB", "--prefix-cache",
                                                "2GiB"],
     r"--prefix-cache 2.00 GiB \(2147483648 bytes\) is not below --memory 1.00 GiB \(1073741824 bytes\): the prefix "
     r"cache is held within the memory"),
    ("serve: a memory size of hundreds of digits", ["serve", "--model", "{model}", "--memory", "9" * 400 + "GiB"],
     r"--memory: memory size '9{20}\.\.\.9{17}GiB' \(403 characters\) is above 1 EiB"),
    ("generate: a budget of hundreds of digits", generate("--budget", "9" * 400 + "slots"),
     r"--budget: budget '9{20}\.\.\.9{15}slots' \(405 characters\) is larger than any machine holds"),
    ("tune: a memory size of hundreds of digits", ["tune", "--model", "{model}", "--memory", "1GiB," + "9" * 400 + "MB"],
     r"--memory: memory size '9{20}\.\.\.9{18}MB' \(402 characters\) is above 1 EiB"),
    ("generate: a seed beyond 64 bits", generate("--sample", "9" * 20),
     r"--sample: 9{20} is not a seed: give a whole number from -2\*\*63 to 2\*\*64-1"),
    ("serve: more threads than torch takes", ["serve", "--model", "{model}", "--threads", "9" * 20],
     r"--threads: 9{20} is not a number of threads in 1..4096"),
    ("trace: a token budget beyond 64 bits", trace("--max-tokens", "9" * 20), r"--max-tokens: 9{20} is too large"),
    ("compare-caches: a batch of more sequences than the trace has tokens",
     [*without(compare(), "--batch-size"), "--batch-size", "10000000000"],
     r"--batch-size 10000000000 is more sequences than trace .*trace has tokens \(60\); give batch sizes up to 60"),
    ("serve: /metrics behind a key that is not given", ["serve", "--model", "{model}", "--metrics-need-key"],
     r"/metrics can need a key only when there is one: give --api-key"),
    ("bench-serve: request timeout not a number", ["bench-serve", "--model", "{model}", "--request-timeout", "soon",
                                                   "--json", "{out}"],
     r"--request-timeout: 'soon' is not a number of seconds"),
    ("bench-serve: unknown policy", ["bench-serve", "--model", "{model}", "--policy", "bogus", "--json", "{out}"],
     r"--policy: unknown cache policy 'bogus'; known"),
    ("bench-serve: a predictor without an artifact", ["bench-serve", "--model", "{model}", "--predictors", "none,freq",
                                                       "--json", "{out}"],
     r"--predictors: predictor 'freq' needs an artifact \(NAME=PATH\); serving loads artifacts only"),
    ("bench: negative transfer workers", ["bench", "--model", "{model}", "--transfer-workers", "-1", "--json", "{out}"],
     r"--transfer-workers: -1 must be at least 1"),
    ("generate: hide-only with a missing timing file", generate("--hide-only", "{tmp}/nowhere.json"),
     r"nowhere.json"),
    ("trace: window of 0 tokens", trace("--seq-len", "0"), r"--seq-len: 0 must be at least 1"),
    ("trace: batch of 0 windows", trace("--batch-size", "0"), r"--batch-size: 0 must be at least 1"),
    ("trace: negative token budget", trace("--max-tokens", "-5"), r"--max-tokens: -5 must be at least 1"),
    ("trace: no logits kept", trace("--top-t", "0"), r"--top-t: 0 must be at least 1"),
    ("trace: --out is a file", [*without(trace(), "--out"), "--out", "{a_file}"],
     r"--out: .*a_file is a file, not a folder; name a folder"),
    ("trace: --out in a folder that cannot hold files", [*without(trace(), "--out"), "--out", NO_FILES],
     CANNOT_HOLD),
    ("evaluate: batch size 0", [*without(evaluate(), "--batch-sizes"), "--batch-sizes", "0"],
     r"--batch-sizes: 0 must be at least 1"),
    ("evaluate: no predictors", [*without(evaluate(), "--predictors"), "--predictors", ""],
     r"--predictors: '' lists nothing; give a comma list"),
    ("evaluate: a batch size given twice", [*without(evaluate(), "--batch-sizes"), "--batch-sizes", "1,8,1"],
     r"--batch-sizes: '1,8,1' names '1' twice; give each once"),
    ("evaluate: a predictor named twice", [*without(evaluate(), "--predictors"), "--predictors", "freq,sida={sida},sida"],
     r"--predictors: predictor 'sida' is named twice; give each name once"),
    ("evaluate: a probe trained on another model",
     [*without(evaluate(), "--predictors"), "--model", "{model}", "--predictors", "probe={probe_other}"],
     r"predictor .*probe-other.json was built for model mixtral\(.*\) but is used with model mixtral\(.*\); rebuild"),
    ("evaluate: a probe without the model it runs", [*without(evaluate(), "--predictors"), "--predictors",
                                                     "probe={probe_other}"],
     r"predictor 'probe' runs the live model: pass --model DIR"),
    ("train: a probe on a trace without hidden states",
     ["train", "--config", PROBE_CONFIG, "--data.trace_dir", "{trace}", "--trainer.logger", "false",
      "--trainer.default_root_dir", "{run}", "--export", "{out}"],
     r"trace .*trace holds no hidden states; trace it again with `prescient trace \.\.\. --hidden-states`"),
    ("compare-caches: the expert pipeline off without a timing", compare("--expert-pipeline", "off"),
     r"the expert pipeline on or off is a model of the timed clock: give --timing"),
    ("compare-caches: one capacity twice", [*without(compare(), "--capacity"), "--capacity", "0.5,50%"],
     r"--capacity: '0.5,50%' names '50%' twice; give each once"),
    ("evaluate: cross garbage", evaluate("--cross", "garbage"),
     r"--cross: entry 'garbage' is not DATASET=TRAIN_TRACE:EVAL_TRACE:ARTIFACT"),
    ("evaluate: expert id out of range", [*without(evaluate(), "--trace"), "--trace", "{trace_ids}"],
     r"trace shard .*shard-00000.safetensors: column topk_ids holds expert id 99 .*outside 0..7.*; delete"),
    ("evaluate: --json is a FIFO", [*without(evaluate(), "--json"), "--json", "{a_fifo}"],
     r"--json: output .*a_fifo is a FIFO, not a file"),
    ("compare-caches: expert id out of range", [*without(compare(), "--trace"), "--trace", "{trace_ids}"],
     r"column topk_ids holds expert id 99 .*outside 0..7 \(the model has 8 experts\); delete .* trace again"),
    ("compare-caches: NaN router logits", [*without(compare(), "--trace"), "--trace", "{trace_nan}"],
     r"column topt_logits holds nan .*router logits must be finite; delete"),
    ("compare-caches: --json inside a file", [*without(compare(), "--json"), "--json", "{a_file}/out.json"],
     r"--json: output .*a_file/out.json: part of its folder path is a file; choose another path"),
    ("train: batch size 0", train("--data.batch_size", "0"), r"--data.batch_size is 0; it must be at least 1"),
    ("train: batch size not a number", train("--data.batch_size", "abc"),
     r"Parser key \"data.batch_size\": Expected a <class 'int'>. Got value: abc \(see `prescient train --help`\)"),
    ("train: missing checkpoint", train("--ckpt_path", "{tmp}/nowhere.ckpt"),
     r"checkpoint .*nowhere.ckpt does not exist; give --ckpt_path"),
    ("train: truncated checkpoint", train("--ckpt_path", "{truncated_ckpt}"),
     r"checkpoint .*truncated.ckpt is truncated or not a checkpoint .*; resume from another"),
    ("train: checkpoint the weights-only loader refuses", train("--ckpt_path", "{unsafe_ckpt}"),
     r"unsafe.ckpt holds what the safe weights-only loader refuses .*; resume only from"),
    ("train: another model than the trace's", train("--model.model_dir", "{other}"),
     r"trace .* was built for model mixtral\(.*\) but is used with model mixtral\(.*\); rebuild"),
    ("quantize: 3 bits", ["quantize", "--model", "{model}", "--bits", "3", "--out", "{run}"],
     r"--bits: invalid choice: 3 \(choose from 2, 4, 8, 16\)"),
    ("quantize: a group size that does not divide", ["quantize", "--model", "{model}", "--bits", "4", "--group-size",
                                                      "24", "--out", "{run}"],
     r"--group-size 24 does not divide the experts' input dimensions \[32\]"),
    ("quantize: --out in a folder that cannot hold files", ["quantize", "--model", "{model}", "--bits", "4",
                                                             "--out", NO_FILES], CANNOT_HOLD),
    ("quantize: an already compressed model", ["quantize", "--model", "{int4}", "--bits", "4", "--out", "{run}"],
     r"int4 is already compressed \(its config.json has a quantization_config\); quantise the uncompressed model"),
    ("bench-compressed: a quality file that is not one", ["bench-compressed", "--models", "a={model},b={int4}",
                                                           "--quality", "b={a_file}", "--json", "{out}"],
     r"--quality .*a_file is not a `prescient quality` JSON .*; write one with prescient quality --json"),
    ("generate: a compressed model with a NaN scale", [*without(generate(), "--model"), "--model", "{int4_nan}"],
     r"experts.1.w2.weight_scale holds NaN or infinite values; the checkpoint is damaged"),
    ("generate: a compressed model with a scale of the wrong shape",
     [*without(generate(), "--model"), "--model", "{int4_scale_shape}"],
     r"experts.1.w2.weight_scale has shape \[16, 1\], but a \[32, 32\] weight in groups of 32 needs \[32, 1\]"),
    ("generate: a compressed model whose scheme quantises activations",
     [*without(generate(), "--model"), "--model", "{int4_w4a8}"],
     r"has a scheme the runtime cannot run: quantised activations \(the runtime runs weight-only schemes\)"),
    ("generate: a temperature without --sample", [*generate(), "--temperature", "0.7"],
     r"--temperature and --top-p shape sampled decoding: give --sample SEED too"),
    ("generate: a temperature of zero", [*generate(), "--sample", "0", "--temperature", "0"],
     r"temperature 0.0 is not a positive number; give e.g. 0.7"),
    ("generate: packed slots without bf16", [*generate(), "--slot-format", "packed"],
     r"packed slots compute with torch's int4/int8 CPU kernels, on bfloat16 activations: use dtype bfloat16"),
    ("generate: packed slots of an uncompressed model", [*generate(), "--dtype", "bfloat16", "--slot-format", "packed"],
     r"stores no expert compressed; packed slots hold int4 or int8 experts \(write them with prescient quantize"),
    ("bench-compressed: --packed names no model", ["bench-compressed", "--models", "a={model},b={int4}", "--packed",
                                                   "c", "--dtype", "bfloat16", "--json", "{out}"],
     r"--packed names c, which --models does not; name models of --models"),
    ("generate: a fine model without packed slots", [*generate(), "--dtype", "bfloat16", "--fine-model", "{int4}"],
     r"mixed precision \(a fine model\) keeps both copies packed in their slots: use slot_format packed"),
    ("generate: a fine share of the whole budget", [*generate(), "--fine-share", "1"],
     r"fine_share must be a share of the budget in \(0, 1\), got 1.0"),
    ("bench-compressed: a mixed entry without a rule", ["bench-compressed", "--models", "a={int4}", "--mixed",
                                                        "m=a+a", "--json", "{out}"],
     r"--mixed: cannot read mixed entry 'm=a\+a'; write NAME=COARSE\+FINE:RULE"),
    ("quantize: gptq at 16 bits", ["quantize", "--model", "{model}", "--bits", "16", "--method", "gptq",
                                   "--out", "{run}"],
     r"--method gptq chooses integer levels on calibration text: it needs --bits 2, 4 or 8"),
    ("quantize: gptq on a calibration dataset that does not exist",
     ["quantize", "--model", "{model}", "--bits", "4", "--method", "gptq", "--calibration", "json:{out}",
      "--out", "{run}"], r"dataset file .*out.json does not exist"),
    ("quantize: a group size that is not a number or channel",
     ["quantize", "--model", "{model}", "--bits", "8", "--group-size", "rows", "--out", "{run}"],
     r"--group-size: .*rows"),
    ("generate: a compressed model missing a shard", [*without(generate(), "--model"), "--model", "{int4_no_shard}"],
     r"weight file .*model-00002-of-00002.safetensors listed in model.safetensors.index.json is missing"),
    ("reference-model: truncated reference.json", ["reference-model", "--out", "{reference}"],
     r"reference/reference.json is not valid JSON .*; delete .*reference to build the model again"),
    ("reference-model: heads that do not divide the hidden size", ["reference-model", "--recipe", "{recipe_heads}",
     "--out", "{run}"], r"recipe_heads.yaml: model.num_attention_heads \(5\) must divide model.hidden_size \(128\)"),
    ("reference-model: top-k above the expert count", ["reference-model", "--recipe", "{recipe_top_k}",
     "--out", "{run}"], r"model.num_experts_per_tok \(17\) is above model.num_local_experts \(16\)"),
    ("reference-model: zero steps", ["reference-model", "--recipe", "{recipe_no_steps}", "--out", "{run}"],
     r"training.max_steps must be at least 1, not 0"),
    ("reference-model: a learning rate that is not a number", ["reference-model", "--recipe", "{recipe_lr_text}",
     "--out", "{run}"], r"training.lr must be float, not 'fast'"),
    ("reference-model: --out in a folder that cannot hold files", ["reference-model", "--out", NO_FILES],
     CANNOT_HOLD),
    ("reference-model: a missing recipe file", ["reference-model", "--recipe", "{tmp}/nowhere.yaml", "--out", "{run}"],
     r"cannot read the recipe .*nowhere.yaml"),
]
if torch.cuda.is_available():  # only a machine without CUDA can refuse it
    CASES = [case for case in CASES if case[0] != "generate: unknown device"]
else:
    CASES.append(("generate: CUDA without CUDA", generate("--device", "cuda"),
                  r"--device: device 'cuda': CUDA is not available on this machine; use --device cpu"))


def snapshot(paths: dict[str, Path]) -> dict[str, object]:
    """Every input file's bytes (by hash), and each special node's type."""
    files = {}
    for root in {paths["model"], paths["tmp"]}:
        for path in sorted(root.rglob("*")):
            mode = path.lstat().st_mode
            regular = stat.S_ISREG(mode)
            files[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest() if regular else stat.S_IFMT(mode)
    return files


@pytest.mark.parametrize("argv, expected", [pytest.param(argv, expected, id=name) for name, argv, expected in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, expected, world, text_corpus, tmp_path, capsys, caplog):
    out = tmp_path / "out.json"
    names = {**world, "corpus": text_corpus, "out": out, "run": tmp_path / "run"}
    args = [arg.format(**names) for arg in argv]
    before = snapshot(world)
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    logged = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    lines = [line for line in err.splitlines() + logged if line.startswith("error:")]
    assert exit_info.value.code == 2
    assert len(lines) == 1 and re.search(expected, lines[0]), (err, logged)
    assert "Traceback" not in err + "".join(logged)
    assert not out.exists() and not out.with_suffix(".safetensors").exists()
    assert snapshot(world) == before


@pytest.mark.slow  # 16 s: a process per damaged file; the default suite ran 639 s on a fresh clone
def test_a_damaged_trace_never_crashes_the_process(world, tmp_path):
    """The case that once segfaulted the compiled cache (exit 139), run as its own process."""
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "cli.main", "compare-caches", "--trace", str(world["trace_ids"]),
                           "--policies", "lru", "--capacity", "0.5", "--batch-size", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [line for line in done.stderr.splitlines() if line.strip()]
    assert [line for line in done.stderr.splitlines() if line.strip()][-1].startswith("error: trace shard")
    assert "Traceback" not in done.stderr and not out.exists()


def run_compare(world: dict[str, Path], json_path: str) -> None:
    main(["compare-caches", "--trace", str(world["trace"]), "--policies", "lru", "--capacity", "0.5",
          "--batch-size", "1", "--json", json_path])


def test_json_through_a_symlink_lands_on_its_target(world, tmp_path):
    target, link = tmp_path / "results.json", tmp_path / "link.json"
    target.write_text("old\n")
    link.symlink_to(target.name)
    run_compare(world, str(link))
    assert link.is_symlink() and os.readlink(link) == target.name
    assert json.loads(target.read_text())["runs"]


def test_a_character_device_is_written_in_place_never_replaced(world):
    before = os.stat("/dev/null")
    run_compare(world, "/dev/null")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_json_to_stdout_appends_after_the_table(world, capfd):
    run_compare(world, "/dev/stdout")
    out = capfd.readouterr().out
    table, _, record = out.partition("{")
    assert "hit" in table and json.loads("{" + record)["runs"]


def test_a_damaged_trace_is_refused_before_a_result_is_replaced(world, tmp_path):
    results = tmp_path / "results.json"
    results.write_text('{"kept": true}\n')
    with pytest.raises(SystemExit):
        main(["compare-caches", "--trace", str(world["trace_nan"]), "--policies", "mrs", "--json", str(results)])
    assert json.loads(results.read_text()) == {"kept": True}
    assert load_trace(world["trace"])  # the good one still loads
