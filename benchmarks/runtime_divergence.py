"""bf16 on the GPU: how often blockdraft's runtime and Hugging Face greedy decoding part ways.

bf16 is not exact: the runtime's kernels and Hugging Face's round differently, so at near-ties
greedy decoding may pick different tokens. This measures it on the built-in pair's target (the
held-out prompts, 128 new tokens each): prompts decoded identically, and for the others the
first differing position and the top-2 logit gap Hugging Face saw there. Also the largest
relative logit difference of one prefill. Writes ``$OUT/runtime_divergence.json`` (or the path
given) and prints a summary line.

    python benchmarks/runtime_divergence.py [OUT_DIR]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import blockdraft
from blockdraft import pretrained


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
    dev = torch.device("cuda")
    target, _, _ = pretrained.builtin_pair(device=dev, dtype=torch.bfloat16)
    prompts = pretrained.heldout_prompts()
    n = 128
    got = blockdraft.decode(target, prompts, max_new_tokens=n).tokens
    same, firsts = 0, []
    for p, g in zip(prompts, got):
        ids = torch.tensor([p], device=dev)
        res = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, pad_token_id=0, eos_token_id=None,
                              return_dict_in_generate=True, output_scores=True)
        want = res.sequences[0, len(p):].tolist()
        if want == g[: len(want)]:
            same += 1
            continue
        i = next(k for k, (a, b) in enumerate(zip(want, g)) if a != b)
        top = torch.topk(res.scores[i][0].float(), 2).values
        firsts.append({"position": i, "hf_top2_gap": float(top[0] - top[1])})
    with torch.no_grad():
        want_logits = target(torch.tensor([prompts[0]], device=dev)).logits[0, -1].float()
    rt = blockdraft.TargetRuntime(target, num_pages=64, page_size=16)
    seq = rt.new_sequence(len(prompts[0]) + 1)
    last = rt.prefill([seq], [prompts[0]])[0].float()
    rel = float((last - want_logits).abs().max() / want_logits.abs().max())
    record = {"prompts": len(prompts), "new_tokens": n, "identical": same, "diverged": firsts,
              "prefill_logits_max_rel_err": rel, "gpu": torch.cuda.get_device_name(dev),
              "torch": torch.__version__}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "runtime_divergence.json").write_text(json.dumps(record, indent=1))
    print(f"bf16 runtime vs HF greedy: {same}/{len(prompts)} identical over {n} tokens; "
          f"first divergences at {[f['position'] for f in firsts]} (HF top-2 gaps "
          f"{[round(f['hf_top2_gap'], 4) for f in firsts]}); prefill logits max rel err {rel:.2e}")


if __name__ == "__main__":
    main()
