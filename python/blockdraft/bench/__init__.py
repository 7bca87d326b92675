"""``blockdraft bench``: proposer latency, batching, memory, host overhead and end-to-end cost.

Everything runs on random weights built in memory at named shapes (no downloads):

| shape | target | drafter |
| --- | --- | --- |
| ``qwen3-8b`` | 36 layers, H 4096, 32/8 heads x 128, MLP 12288, vocab 151936 | 5 layers, ids [1,9,17,25,33], B 16 |
| ``qwen3-4b`` | 36 layers, H 2560, 32/8 heads x 128, MLP 9728, vocab 151936 | 5 layers, ids [1,9,17,25,33], B 16 |
| ``tiny`` | 4 layers, H 64, 4/2 heads x 16, MLP 128, vocab 512 | 2 layers, ids [1, 2], B 8 |

Sections of one run (each recorded in the JSON even when another fails):

* ``propose``: per context length and batch size, the latency of ``propose`` (n = 1) or
  ``propose_batch`` (median, p90; on CUDA timed with CUDA events around the call, which ends
  in a host sync, elsewhere with the wall clock), the same ``n`` sequences through ``n``
  ``propose`` calls, the plain (no CUDA graph) path, the ctx K/V precompute of 1 and B new
  rows per sequence, and drafter memory per sequence (accumulator + paged K/V) measured from
  the tensors and from the formula.
* ``reference``: the public reference's drafter forward (``dflash`` 0.1.0, same weights and
  inputs, batch 1) with the flash SDPA backend and with torch's default choice.
* ``host``: a cProfile of ``propose`` split into blockdraft Python, the Rust core, kernel
  launches, and waiting for the device; plus the core's bookkeeping alone, timed without the
  profiler.
* ``kernels``: device time per kernel of proposals on the graph and the plain path, and the
  wall time of the same calls (torch.profiler; CUDA only).
* ``e2e``: batch-1 speculative decoding, blockdraft's engine against ``dflash_generate``, ms
  per step and the drafter's share.
* ``target``: one target forward (decode, verify) on Hugging Face eager and on blockdraft's
  runtime, eager and graphed.
* ``spec``: the engine's whole speculative step, the same sequences' target-only decode step,
  and the step's host work alone (graph replays stubbed out); the report puts these beside the
  ``e2e`` reference in one table with tokens/s derived at a trained pair's τ
  (:mod:`blockdraft.bench.side_by_side`).

Each step of the propose section commits one new ctx row per sequence (a random pair accepts
nothing, so a step adds ``accepted + 1 = 1`` row), so every timed call includes the K/V
precompute of that row, as in steady state.

The shapes and the random pairs built at them are :mod:`blockdraft.pair`'s.
The modules: ``timing``, ``workload`` (the bench's
proposers and live sequences), ``memory``, one module per section (``propose``, ``reference``,
``host``, ``kernels``, ``e2e``, ``quick``, ``target``, ``spec``), ``side_by_side``
(the table built from ``spec`` and ``e2e``), ``driver`` (one run), ``report``
(markdown, plots, files) and ``command`` (the CLI options).
"""

from __future__ import annotations

from blockdraft.bench.command import add_arguments, config_from_args, default_out_dir, main_from_args
from blockdraft.bench.config import BenchConfig
from blockdraft.bench.driver import SCHEMA_VERSION, SECTIONS, environment, resolve, run
from blockdraft.bench.e2e import bench_e2e
from blockdraft.bench.host import bench_core_bookkeeping, bench_host
from blockdraft.bench.kernels import bench_kernels
from blockdraft.bench.memory import state_memory
from blockdraft.bench.propose import bench_propose
from blockdraft.bench.quick import QUICK_CELLS, QUICK_TARGETS_MS, bench_quick, quick_markdown
from blockdraft.bench.reference import bench_reference, build_reference_drafter
from blockdraft.bench.report import plot, to_markdown, write_outputs
from blockdraft.bench.timing import timing_method
from blockdraft.bench.workload import Seqs, make_proposer, release

__all__ = [
    "QUICK_CELLS",
    "QUICK_TARGETS_MS",
    "SCHEMA_VERSION",
    "SECTIONS",
    "BenchConfig",
    "Seqs",
    "add_arguments",
    "bench_core_bookkeeping",
    "bench_e2e",
    "bench_host",
    "bench_kernels",
    "bench_propose",
    "bench_quick",
    "bench_reference",
    "build_reference_drafter",
    "config_from_args",
    "default_out_dir",
    "environment",
    "main_from_args",
    "make_proposer",
    "plot",
    "quick_markdown",
    "release",
    "resolve",
    "run",
    "state_memory",
    "timing_method",
    "to_markdown",
    "write_outputs",
]
