"""The eager decode step of a Llama-style decoder against Hugging Face transformers' own.

``python -m benchmarks.llama_hf --out benchmarks/results`` (torch env; needs ``transformers``)
builds a random 2-block ``LlamaForCausalLM`` (hidden 256, 8 heads, 2 key/value heads), converts
its weights (:func:`attention_core.from_hf_llama`) into this library's torch
``TransformerDecoder``, prefills the same prompt of 128 tokens in both, and then times greedy
decode steps, one token per step, against each one's cache: ours a tensor pair per block,
transformers' a ``DynamicCache``. Each round runs ``STEPS`` steps of each model, interleaved, from
the same prefilled caches (transformers' is copied before its round: it grows in place), and
the ratio ``time(ours) / time(transformers)`` per round gives the median and its 95% interval.
Both models must choose the same tokens. Batch 1 and 8. It writes ``llama-hf-torch.json``;
``--merge DIR --page FILE`` renders it into the table between ``<!-- llama-hf:start -->`` and
``<!-- llama-hf:end -->`` of ``FILE``. Run from the repository root.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import attention_core as ac
from benchmarks.run import machine_info
from benchmarks.timing import median_interval
from tools import markdown

CONFIG: dict[str, Any] = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
          "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "max_position_embeddings": 512}
PROMPT, STEPS = 128, 32
MARKERS = ("<!-- llama-hf:start -->", "<!-- llama-hf:end -->")


def models(seed: int = 0) -> tuple[Any, Any]:
    """Transformers' model and ours, with the same (converted) weights, in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found]

    from backends.torch import TransformerDecoder

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="sdpa")).eval()
    state = {name: value.detach().numpy() for name, value in hf.state_dict().items()}
    weights, kwargs = ac.from_hf_llama(state, CONFIG)
    ours = TransformerDecoder(**kwargs, keep_attention_weights=False).eval()
    ours.set_weights(weights)
    return hf, ours


def _decode_ours(ours: Any, first: Any, cache: Any, start: int, steps: int) -> list[int]:
    tokens, ids = [], first
    for t in range(steps):
        logits, cache = ours(ids, cache=cache, start=start + t)
        ids = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(ids)
    return [int(x) for x in np.concatenate([i.numpy() for i in tokens], 1).ravel()]


def _decode_hf(hf: Any, first: Any, cache: Any, steps: int) -> list[int]:
    tokens, ids = [], first
    for _ in range(steps):
        out = hf(input_ids=ids, cache=cache, use_cache=True)
        cache = out.past_key_values
        ids = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(ids)
    return [int(x) for x in np.concatenate([i.numpy() for i in tokens], 1).ravel()]


def measure(batch: int, rounds: int) -> dict[str, Any]:
    """Interleaved rounds of ``STEPS`` decode steps of both models at one batch size."""
    import torch

    hf, ours = models()
    prompt = torch.randint(0, CONFIG["vocab_size"], (batch, PROMPT),
                           generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        logits, cache = ours(prompt, capacity=PROMPT + STEPS)
        first = logits[:, -1].argmax(-1, keepdim=True)
        prefilled = hf(input_ids=prompt, use_cache=True).past_key_values
        same = _decode_ours(ours, first, cache, PROMPT, STEPS) == _decode_hf(
            hf, first, copy.deepcopy(prefilled), STEPS)
        ratios, ours_s, hf_s = [], [], []
        for r in range(rounds + 1):
            held = copy.deepcopy(prefilled)
            order = (0, 1) if r % 2 else (1, 0)
            took = [0.0, 0.0]
            for which in order:
                begin = time.perf_counter()
                if which == 0:
                    _decode_ours(ours, first, cache, PROMPT, STEPS)
                else:
                    _decode_hf(hf, first, held, STEPS)
                took[which] = time.perf_counter() - begin
            if r:  # the first round warms both up
                ratios.append(took[0] / took[1])
                ours_s.append(took[0] / STEPS)
                hf_s.append(took[1] / STEPS)
    return {"batch": batch, "prompt": PROMPT, "steps": STEPS, "same_tokens": same,
            "ours_ms_per_step": 1e3 * float(np.median(ours_s)),
            "hf_ms_per_step": 1e3 * float(np.median(hf_s)),
            "ratio": median_interval(ratios).as_dict()}


def run(rounds: int) -> dict[str, Any]:
    """Both batch sizes, with the versions and the machine."""
    import torch
    import transformers

    return {"machine": machine_info(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "config": CONFIG, "results": [measure(b, rounds) for b in (1, 8)]}


def table(result: dict[str, Any]) -> str:
    """The Markdown table of one result file."""
    rows = ["| batch | ours ms/step | transformers ms/step | ours ÷ transformers [95% CI] | "
            "same tokens | rounds |", "|---|---|---|---|---|---|"]
    for r in result["results"]:
        q = r["ratio"]
        rows.append(f"| {r['batch']} | {r['ours_ms_per_step']:.2f} | {r['hf_ms_per_step']:.2f} | "
                    f"{q['median']:.2f} [{q['low']:.2f}, {q['high']:.2f}] | "
                    f"{'yes' if r['same_tokens'] else 'no'} | {q['rounds']} |")
    m = result["machine"]
    rows.append("")
    rows.append(f"torch {result['torch']}, transformers {result['transformers']}, "
                f"threads: {result['threads']}, {m.get('cpu', '?')}, {m.get('date', '?')[:10]}.")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark or merges its file into a page."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llama_hf", description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--merge", type=Path, metavar="DIR")
    parser.add_argument("--page", type=Path, default=Path("docs/speed.md"))
    args = parser.parse_args(argv)
    if args.merge:
        result = json.loads((args.merge / "llama-hf-torch.json").read_text())
        markdown.write_between_markers(args.page, table(result), *MARKERS)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args.rounds)
    (args.out / "llama-hf-torch.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
