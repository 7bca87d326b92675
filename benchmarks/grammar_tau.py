"""τ of the built-in pair with and without a grammar: the same held-out prompts, greedy,
unconstrained, then under a JSON schema and under "any JSON object". Under a grammar the target
verifies every draft under the exact mask after the drafts before it, and the drafter sees the
first draft's mask only (docs/design/structured-outputs.md), so τ measures how often the
drafter's unconstrained guesses after the first are what the constrained target writes.

Also counts the outputs that ended at the end token (the rest ran to ``--new``) and the
constrained ones that parse and validate against the schema (``jsonschema``), and times each
run (a one-off engine per run, warmed by one untimed run first). Prints a table
and writes ``grammar_tau.json`` under the given directory (or ``$OUT``).

    python benchmarks/grammar_tau.py [OUT_DIR] [--device cpu|cuda] [--prompts N] [--new N] [--block-size 8|16]
        [--draft-length K|adaptive]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

import blockdraft
from blockdraft import pretrained
from blockdraft.grammar import GrammarSpec

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
        "enabled": {"type": "boolean"},
        "retries": {"type": "integer", "minimum": 0, "maximum": 10},
        "mode": {"enum": ["fast", "safe", "debug"]},
        "paths": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
    },
    "required": ["name", "version", "enabled", "retries", "mode", "paths"],
    "additionalProperties": False,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=pretrained.DEFAULT_BLOCK_SIZE, choices=(8, 16))
    ap.add_argument("--draft-length", default=None,
                    help="drafts per step: a number or 'adaptive' (default: B - 1, the drafter alone)")
    args = ap.parse_args()
    draft_length: int | str = args.block_size - 1 if args.draft_length is None else args.draft_length
    if draft_length != "adaptive":
        draft_length = int(draft_length)
    target, drafter, tokenizer = pretrained.builtin_pair(device=args.device, dtype=torch.float32,
                                                         block_size=args.block_size)
    prompts = pretrained.heldout_prompts()[: args.prompts]
    eos = int(tokenizer.eos_token_id)
    runs: dict[str, GrammarSpec | None] = {"none": None, "json_schema": GrammarSpec.json_schema(SCHEMA),
                                           "json_object": GrammarSpec.json_object()}
    rows = []
    for name, spec in runs.items():
        def run(spec: GrammarSpec | None = spec) -> blockdraft.GenerationResult:
            return blockdraft.generate(target, drafter, prompts, max_new_tokens=args.new, stop_token_ids=[eos],
                                       grammar=spec, tokenizer=tokenizer, draft_length=draft_length)
        run()  # warm
        t0 = time.perf_counter()
        res = run()
        seconds = time.perf_counter() - t0
        tokens = sum(len(t) for t in res.tokens)
        valid = sum(_valid(tokenizer.decode(t, skip_special_tokens=True), name) for t in res.tokens)
        ended = sum(1 for t in res.tokens if t and t[-1] == eos)
        rows.append({"grammar": name, "tau": res.stats.mean_tau, "tokens": tokens,
                     "tok_per_s": tokens / seconds, "valid": valid if spec is not None else None,
                     "ended": ended, "outputs": len(prompts)})
    record = {"device": args.device, "block_size": args.block_size, "draft_length": draft_length,
              "prompts": len(prompts),
              "new_tokens": args.new, "torch": torch.__version__, "python": platform.python_version(),
              "machine": platform.machine(), "rows": rows}
    print(f"built-in pair, B = {args.block_size}, draft length {draft_length}, {len(prompts)} held-out prompts "
          f"x at most {args.new} new tokens, greedy, {args.device}:")
    print("| grammar | τ | tokens | tok/s | ended by the end token | valid outputs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        valid = "—" if r["valid"] is None else f"{r['valid']} / {r['outputs']}"
        print(f"| {r['grammar']} | {r['tau']:.2f} | {r['tokens']} | {r['tok_per_s']:.1f} | "
              f"{r['ended']} / {r['outputs']} | {valid} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grammar_tau.json").write_text(json.dumps(record, indent=1))


def _valid(text: str, grammar: str) -> bool:
    try:
        value = json.loads(text)
        if grammar == "json_schema":
            jsonschema.validate(value, SCHEMA)
        return isinstance(value, dict)
    except (ValueError, jsonschema.ValidationError):
        return False


if __name__ == "__main__":
    main()
