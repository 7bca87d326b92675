"""What one ``blockdraft bench`` run measures."""

from __future__ import annotations

from dataclasses import dataclass, field

from blockdraft.bench.side_by_side import PUBLIC_TAU


@dataclass
class BenchConfig:
    """What one ``blockdraft bench`` run measures.

    Attributes:
        shape: a key of :data:`~blockdraft.pair.SHAPES`.
        contexts: context lengths (ctx rows per sequence).
        batches: batch sizes (sequences per proposal).
        reps / warmup: timed and untimed calls per cell.
        loop_reps: repetitions of the per-sequence loop (n ``propose`` calls each).
        e2e_steps: speculative steps per end-to-end run.
        e2e_repeats: end-to-end runs per engine and cell, alternating the engines; the median
            run is reported.
        e2e_backends: the SDPA settings of the end-to-end section on CUDA, in run order
            ("flash", "default").
        device / dtype: where and in what precision (``dtype`` "auto": bf16 on CUDA, fp32 else).
        sections: which sections to run (see :mod:`blockdraft.bench`).
        seed: weights and inputs.
        profile_context / profile_batches: the host profile's cell(s).
        spec_caps: the drafter's context-window caps the ``spec`` section runs every cell
            under, in order (``None``: the environment's ``BLOCKDRAFT_DFLASH_CTX_CAP``, by
            default 16384; ``0``: uncapped), so a capped and an uncapped step are measured on
            the same pair in one run.
        max_seq_len: the longest sequence the ``spec`` section's engines take (``None``: each
            cell's context plus its steps). A server's runtime is sized for its longest
            sequence, and its page tables (and the attention's splits over them) with it.
        public_tau: the tokens per step of a trained pair at which the side-by-side table
            derives tokens/s from the measured steps
            (:data:`~blockdraft.bench.side_by_side.PUBLIC_TAU`).
    """

    shape: str = "tiny"
    contexts: list[int] = field(default_factory=lambda: [512, 4096, 16384])
    batches: list[int] = field(default_factory=lambda: [1, 4, 16, 32, 64])
    reps: int = 20
    warmup: int = 3
    loop_reps: int = 5
    e2e_steps: int = 24
    e2e_repeats: int = 1
    e2e_backends: list[str] = field(default_factory=lambda: ["flash", "default"])
    device: str = "auto"
    dtype: str = "auto"
    sections: list[str] = field(
        default_factory=lambda: ["propose", "reference", "e2e", "host", "kernels"]
    )
    seed: int = 0
    profile_context: int | None = None
    profile_batches: list[int] = field(default_factory=lambda: [1, 32])
    spec_caps: list[int | None] = field(default_factory=lambda: [None])
    max_seq_len: int | None = None
    public_tau: float = PUBLIC_TAU

    def wide_context(self) -> int:
        """The context of the host profile and of the kernel profile's batched cells: the
        ``profile_context``, else the second context, else the only one."""
        if self.profile_context:
            return self.profile_context
        return self.contexts[1] if len(self.contexts) > 1 else self.contexts[0]

    def profiled_batches(self) -> list[int]:
        """The host and kernel profiles' batch sizes: ``profile_batches`` capped at the
        largest batch, ascending, without repeats."""
        return sorted({min(n, max(self.batches)) for n in self.profile_batches})
